"""Rules about what differs per rank and what must not: device indices, process-group ranks, seeds, splits,
and context managers that were called instead of entered.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from .analysis import Module
from .astutil import dotted, is_const, kwarg, pos
from .registry import Hit, rule
from .rules_model import seeded_before
from .values import rank_dependent, rank_kind

_ENV = re.compile(r"(?:^|_)envs?(?:_|$)|^environments?$", re.IGNORECASE)
_MAKE_ENV = re.compile(r"^make(?:_vec)?_?env$|^make$", re.IGNORECASE)


@rule(
    "unseeded-split",
    "PTL017",
    "error",
    "random_split / train_test_split with no seed shared by every rank in a distributed script",
    "random_split(ds, lengths, generator=torch.Generator().manual_seed(SEED)) "
    "(train_test_split(..., random_state=SEED)), the same SEED on every rank",
)
def unseeded_split(m: Module) -> Iterator[Hit]:
    """A random train/test split drawn independently on each rank.

    Why: every rank draws its own permutation, so each trains on a different "training set" and tests on a
    different "test set": test samples leak into other ranks' training, and the reported test figure is
    measured on data the model has trained on. Reported for ``torch.utils.data.random_split`` without a
    ``generator=`` when no same-on-every-rank ``torch.manual_seed`` comes before it, and for scikit-learn's
    ``train_test_split`` without ``random_state=`` (or with ``random_state=None``). Not reported: a split
    made under a rank condition (rank 0 prepares the data), ``shuffle=False``, and single-process scripts.
    Fix: a generator seeded with the same value on every rank.
    """
    if not m.is_distributed:
        return
    for c in m.calls_to("random_split", "train_test_split"):
        last = m.callee(c).rpartition(".")[2]
        if m.rank_guarded(c):
            continue
        if last == "random_split":
            gen = kwarg(c, "generator") or (c.args[2] if len(c.args) > 2 else None)
            if gen is not None and not is_const(gen, None):
                continue
            if seeded_before(m, c):
                continue
            what = "random_split without a seeded generator"
        else:
            if is_const(kwarg(c, "shuffle"), False):
                continue
            state = kwarg(c, "random_state")
            if state is not None and not is_const(state, None):
                continue
            what = "train_test_split without random_state"
        yield Hit(
            c,
            f"{what}: each rank draws its own split, so every rank trains and tests on different samples "
            "(test data leaks into other ranks' training)",
        )


_DEVICE_CALLS = ("set_device", "set_device_index", "device_index", "device")


def _device_index_args(m: Module) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(node to report, the expression used as a CUDA device index) for each place a device is chosen."""
    for c in m.calls:
        callee = m.callee(c)
        last = callee.rpartition(".")[2]
        if isinstance(c.func, ast.Attribute) and last in ("to", "cuda") and c.args:
            if callee not in ("torch.cuda", "torch.cuda.cuda"):
                yield c, c.args[0]
        elif last in _DEVICE_CALLS and callee.startswith(("torch.cuda.", "torch.accelerator.")) and c.args:
            yield c, c.args[0]
        elif callee == "torch.device" and len(c.args) > 1:
            yield c, c.args[1]
        for key in ("device_ids", "output_device", "device_id", "device"):
            value = kwarg(c, key)
            if isinstance(value, ast.List | ast.Tuple):
                yield from ((c, e) for e in value.elts)
            elif (value is not None and key != "device") or (
                value is not None and callee.startswith("torch.")
            ):
                yield c, value
    for n in m.nodes:  # f"cuda:{rank}"
        if isinstance(n, ast.JoinedStr) and len(n.values) == 2:
            head, value = n.values
            if (
                isinstance(head, ast.Constant)
                and str(head.value).endswith(("cuda:", "xpu:", "npu:"))
                and isinstance(value, ast.FormattedValue)
            ):
                yield n, value.value


@rule(
    "global-rank-as-device",
    "PTL018",
    "error",
    "the global rank (RANK, dist.get_rank()) used as the CUDA device index",
    'use the local rank: local_rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(local_rank)',
)
def global_rank_as_device(m: Module) -> Iterator[Hit]:
    """The global rank where the node-local one belongs.

    Why: device indices are per node (0..GPUs per node - 1); on a second node the global rank is 8, 9, ...,
    which names no GPU there ("invalid device ordinal"), or with fewer GPUs per node than ranks picks the
    wrong one. It works on one node, so the bug hides until the first multi-node run. Reported where a
    device is chosen (``.to(r)``, ``.cuda(r)``, ``device_ids=[r]``, ``torch.cuda.set_device(r)``,
    ``torch.device("cuda", r)``, ``f"cuda:{r}"``) with ``r`` the global rank as this file shows it:
    ``dist.get_rank()``, ``int(os.environ["RANK"])``, or a name bound to one. Not reported: a bare ``rank``
    whose origin the file does not show, ``rank % torch.cuda.device_count()``, scripts that start their
    own processes on one machine (``mp.spawn``: there the rank is the local rank), and scripts that set
    ``CUDA_VISIBLE_DEVICES`` themselves.
    Fix: ``LOCAL_RANK``.
    """
    if not m.is_distributed or m.spawns:
        return
    if any(isinstance(n, ast.Constant) and n.value == "CUDA_VISIBLE_DEVICES" for n in m.nodes):
        return
    by_scope: dict[ast.AST, list[tuple[ast.AST, ast.AST]]] = {}
    for node, index in _device_index_args(m):
        if rank_kind(m, index, node) == "global":
            by_scope.setdefault(m.scope_of(node), []).append((node, index))
    for uses in by_scope.values():  # one choice of device variable per function: one finding
        node, index = min(uses, key=lambda u: pos(u[0]))
        lines = sorted({pos(u[0])[0] for u in uses} - {pos(node)[0]})
        more = f" (also line{'s' if len(lines) > 1 else ''} {', '.join(map(str, lines))})" if lines else ""
        yield Hit(
            node,
            f"`{ast.unparse(index)}` is the global rank, used as a device index{more}: on every node but the "
            "first it names a GPU that does not exist there (device indices are per node)",
        )


def _env_seed(m: Module, c: ast.Call) -> ast.expr | None:
    """The seed an environment is given: ``env.reset(seed=s)``, ``env.seed(s)``, ``make_env(..., seed=s)``."""
    f = c.func
    last = m.callee(c).rpartition(".")[2]
    receiver = dotted(f.value) if isinstance(f, ast.Attribute) else None
    if receiver is not None and any(_ENV.search(part) for part in receiver.split(".")):
        if last == "reset":
            return kwarg(c, "seed")
        if last == "seed":
            return c.args[0] if c.args else kwarg(c, "seed")
    if _MAKE_ENV.match(last) and ("gym" in m.callee(c) or "env" in last.lower()):
        return kwarg(c, "seed")
    return None


@rule(
    "rank-independent-seed",
    "PTL019",
    "warning",
    "an environment (RL rollouts) seeded with the same value on every rank",
    "seed each rank's environments differently: env.reset(seed=seed + rank * num_envs)",
)
def rank_independent_seed(m: Module) -> Iterator[Hit]:
    """Every rank seeding its environment identically.

    Why: in distributed RL each rank collects its own rollouts so that the ranks see different experience;
    with the same environment seed on every rank they collect identical trajectories, and N ranks do the
    work of one while the effective batch looks N times larger. Reported in a distributed script for
    ``env.reset(seed=s)``, ``env.seed(s)`` and ``make_env(..., seed=s)`` (a receiver with a part named
    ``env``/``envs``/``train_env``..., as in ``self.env.reset``) when ``s`` does not depend on the rank,
    directly or through the names it is computed from.
    A warning: a deterministic environment, or one seeded differently elsewhere, is fine. Not reported:
    ``reset()`` without a seed, and calls under a rank condition. (The model's seed is the opposite case:
    it must be the same everywhere; see ``unseeded-init``.)
    Fix: add the rank to the environment's seed.
    """
    if not m.is_distributed:
        return
    for c in m.calls:
        seed = _env_seed(m, c)
        if seed is None or is_const(seed, None) or m.rank_guarded(c) or rank_dependent(m, seed, c):
            continue
        yield Hit(
            c,
            f"the environment is seeded with `{ast.unparse(seed)}`, the same on every rank: all ranks "
            "collect identical rollouts",
        )


# Callables that only act inside `with`: called as a statement they build an object and drop it.
_CM_METHODS = frozenset({"no_sync", "no_backward_sync"})
_CM_TORCH = frozenset(
    {
        "torch.no_grad",
        "torch.enable_grad",
        "torch.inference_mode",
        "torch.autocast",
        "torch.amp.autocast",
        "torch.cuda.amp.autocast",
        "torch.cpu.amp.autocast",
        "torch.cuda.device",
        "torch.cuda.stream",
        "torch.accelerator.device_index",
        "torch.nn.attention.sdpa_kernel",
        "torch.distributed.algorithms.join.Join",
    }
)


@rule(
    "context-manager-not-entered",
    "PTL020",
    "error",
    "a context manager (model.no_sync(), torch.accelerator.device_index(i), torch.no_grad()...) called as a "
    "plain statement, which does nothing",
    "enter it: `with model.no_sync():` around the code it should cover (for the device: "
    "torch.accelerator.set_device_index(i) / torch.cuda.set_device(i))",
)
def context_manager_not_entered(m: Module) -> Iterator[Hit]:
    """A context manager used as a function call.

    Why: ``model.no_sync()``, ``torch.accelerator.device_index(i)``, ``torch.cuda.device(i)``,
    ``torch.no_grad()``, ``torch.autocast(...)`` and the like return an object whose ``__enter__`` does the
    work; on a line of its own the object is built and dropped, so gradients are still all-reduced, the
    current device is unchanged (every rank stays on GPU 0), or autograd still records. Reported for a call
    of one of these that is an expression statement (its value unused). Not reported: ``with ...:``, a
    result that is stored or returned, decorators (``@torch.no_grad()``), and ``torch.set_grad_enabled``
    (which is also a plain function).
    Fix: ``with ...:``, or the function that sets the state (``set_device_index``).
    """
    for n in m.nodes:
        if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)):
            continue
        c = n.value
        callee = m.callee(c)
        last = callee.rpartition(".")[2]
        method = isinstance(c.func, ast.Attribute) and last in _CM_METHODS
        accumulate = last == "accumulate" and "accelerator" in (dotted(c.func) or "").lower()
        if not (method or accumulate or callee in _CM_TORCH):
            continue
        yield Hit(
            c,
            f"{ast.unparse(c.func)}(...) is a context manager called as a statement: it is built and "
            "dropped without being entered, so it has no effect",
        )


@rule(
    "local-rank-as-rank",
    "PTL021",
    "error",
    "the node-local rank passed where the global rank belongs (init_process_group(rank=local_rank), "
    "DistributedSampler(rank=local_rank))",
    'pass the global rank (int(os.environ["RANK"])), or leave rank= out under torchrun',
)
def local_rank_as_rank(m: Module) -> Iterator[Hit]:
    """``LOCAL_RANK`` given as the process's rank in the job.

    Why: on several nodes every node has a local rank 0; ``init_process_group(rank=local_rank)`` makes
    several processes claim rank 0 (rendezvous fails or hangs), and ``DistributedSampler(rank=local_rank)``
    gives every node the same shards (each sample is read once per node, others never). It works on one
    node, so it hides until the first multi-node run. Reported for ``rank=`` of ``init_process_group``,
    ``DistributedSampler`` and ``new_group``-style calls bound to ``LOCAL_RANK`` (``os.environ["LOCAL_RANK"]``,
    ``get_local_rank()``, or a name spelled ``local_rank``). Not reported: scripts that start their own
    processes on one machine (``mp.spawn``), where local and global ranks coincide.
    Fix: the global rank, or no ``rank=`` (torchrun's environment provides it).
    """
    if m.spawns:
        return
    for c in m.calls_to("init_process_group", "DistributedSampler"):
        value = kwarg(c, "rank")
        if value is None and m.callee(c).endswith("init_process_group") and len(c.args) > 4:
            value = c.args[4]
        if value is None or rank_kind(m, value, c) != "local":
            continue
        what = m.callee(c).rpartition(".")[2]
        yield Hit(
            value,
            f"{what}(rank={ast.unparse(value)}) passes the node-local rank as the global rank: on "
            "several nodes, processes on different nodes claim the same rank",
        )
