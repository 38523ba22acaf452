"""Rules about processes and devices: DataParallel, wrap-before-move, hard-coded devices, losses off device.

The classic DDP pitfalls about devices.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from .analysis import Module
from .astutil import dotted, identifiers, is_const, is_device_move, kwarg, names_in, pos, root_name
from .registry import Hit, rule

_DEVICE_WORD = re.compile(r"device|cuda|(?:^|_)rank$|^dev$", re.IGNORECASE)
_COPIES = ("deepcopy", "copy", "clone")
_CUDA_INDEX = re.compile(r"^cuda:\d+$")
_DISTRIBUTED_TEST = re.compile(r"world|ddp|distributed|is_initialized|rank", re.IGNORECASE)


def _moves(m: Module, name: str, scope: ast.AST) -> list[ast.Call]:
    """Device moves of ``name`` in ``scope``: ``name.to(dev)``, ``name.cuda()``, ``name = x.to(dev)``."""
    out = []
    for n in m.scope_nodes(scope):
        if not (isinstance(n, ast.Call) and is_device_move(n) and isinstance(n.func, ast.Attribute)):
            continue
        receiver = n.func.value
        if dotted(receiver) == name or root_name(receiver) == name.split(".", 1)[0] == name:
            out.append(n)
            continue
        # name = Model(...).to(device) / name = torch.compile(Model().cuda())
        stmt = next((a for a in m.ancestors(n) if isinstance(a, ast.stmt)), None)
        if isinstance(stmt, ast.Assign) and any(dotted(t) == name for t in stmt.targets):
            out.append(n)
    return out


def _built_on_device(m: Module, node: ast.AST) -> bool:
    """Inside ``with torch.device(...)``, or after ``torch.set_default_device(...)`` anywhere in the file."""
    if m.calls_to("set_default_device"):
        return True
    for a in m.ancestors(node):
        if isinstance(a, ast.With | ast.AsyncWith):
            for item in a.items:
                e = item.context_expr
                if isinstance(e, ast.Call) and m.qualname(e.func) in ("torch.device", "device"):
                    return True
    return False


def _wrapped_name(m: Module, call: ast.Call) -> str | None:
    """The model a wrapper receives: ``model``, ``self.model``, or the root of ``for b in model.blocks``."""
    arg = call.args[0] if call.args else kwarg(call, "module")
    if arg is None:
        return None
    name = dotted(arg)
    if isinstance(arg, ast.Name):
        for loop in m.enclosing_loops(call):
            if isinstance(loop, ast.For) and arg.id in names_in(loop.target):
                return root_name(loop.iter)
    return name or root_name(arg)


def _evaluation_only(m: Module) -> bool:
    """The file never calls ``backward()`` and does switch autograd off or the model to eval mode."""
    if m.calls_to("backward"):
        return False
    return bool(m.calls_to("no_grad", "inference_mode", "eval"))


@rule(
    "data-parallel",
    "PTL001",
    "warning",
    "nn.DataParallel used instead of DistributedDataParallel",
    "launch one process per GPU (torchrun) and wrap the model in "
    "torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])",
)
def data_parallel(m: Module) -> Iterator[Hit]:
    """``nn.DataParallel`` is one process driving every GPU with threads.

    Why: the GIL serializes the Python work, GPU 0 gathers every output and gradient (memory and time
    imbalance), and the model is re-replicated every forward: 2-3x on 8 GPUs where DDP gets 7-8x. A
    warning: the results are right, the GPUs are wasted. One finding per function. Not reported: the
    single-process fallback of a script that also has a distributed path (``DataParallel`` under
    ``if args.distributed: ... else:`` or ``if world_size == 1``), and evaluation-only files (no
    ``backward()``, and ``torch.no_grad()``/``inference_mode()``/``.eval()``), where the gradient
    gathering that makes it slow does not happen and a single process is a fair choice.
    Fix: one process per GPU under torchrun, and ``DistributedDataParallel``.
    """
    if _evaluation_only(m):
        return
    by_scope: dict[ast.AST, list[ast.Call]] = {}
    for c in m.calls:
        if m.is_torch(c, "DataParallel") and not _single_process_branch(m, c):
            by_scope.setdefault(m.scope_of(c), []).append(c)
    for calls in by_scope.values():  # wrapping the generator and the discriminator: one decision
        more = f" (and {len(calls) - 1} more here)" if len(calls) > 1 else ""
        yield Hit(
            calls[0],
            f"nn.DataParallel{more} runs every GPU from one process (GIL-bound, GPU 0 gathers "
            "everything); it scales 2-3x on 8 GPUs where DistributedDataParallel scales 7-8x",
        )


@rule(
    "ddp-before-device",
    "PTL002",
    "error",
    "a model wrapped in DDP (or FSDP without a device) before it is moved to its device",
    "move first, then wrap: model = model.to(device); model = DDP(model, device_ids=[local_rank]) "
    "(FSDP: pass device_id=local_rank, or device_mesh=)",
)
def ddp_before_device(m: Module) -> Iterator[Hit]:
    """``DDP(model)`` before ``model.to(device)``.

    Why: DDP records the module's device and registers its gradient hooks and buckets when it is built; a
    model moved afterwards (or never, with ``device_ids`` given) fails with "Expected all tensors to be on
    the same device" or a device_ids error. FSDP (v1) without ``device_id``/``device_mesh`` keeps a CPU
    model's shards on the CPU. ``DDP(model.to(device))`` is fine. ``fully_shard`` moves a CPU model to the
    mesh's device itself, so it is reported only when an explicit move comes after it (``to_empty`` after
    a meta-device build is the correct pattern and is not reported).
    Fix: ``model.to(device)`` before wrapping, or pass ``device_id``/``device_mesh`` to FSDP.
    """
    for call, kind in m.wrapper_calls():
        if kind != "ddp" and any(kwarg(call, k) is not None for k in ("device_mesh", "mesh", "device_id")):
            continue
        arg = call.args[0] if call.args else kwarg(call, "module")
        if arg is None or any(isinstance(n, ast.Call) and is_device_move(n) for n in ast.walk(arg)):
            continue  # DDP(model.to(device))
        name = _wrapped_name(m, call)
        if name is None or _built_on_device(m, call):
            continue
        scope = m.scope_of(call)
        moves = _moves(m, name, scope)
        results = [name]
        parent = m.parents.get(call)
        if isinstance(parent, ast.Assign):
            results += [d for t in parent.targets if (d := dotted(t))]
        late = [
            c
            for r in results
            for c in _moves(m, r, scope)
            if pos(c) > pos(call) and isinstance(c.func, ast.Attribute) and c.func.attr != "to_empty"
        ]
        wrapper = {"ddp": "DDP", "fsdp": "FSDP", "fully_shard": "fully_shard"}[kind]
        if any(pos(c) < pos(call) for c in moves):
            continue
        if late:
            first = min(late, key=pos)
            yield Hit(
                call,
                f"{wrapper} wraps `{name}` before it is moved to its device (line {first.lineno}): "
                "the wrapper is built around the model's current (CPU) placement",
                severity="warning" if kind == "fully_shard" else None,
            )
            continue
        if kind == "fully_shard":
            continue  # FSDP2 moves a CPU model to its mesh's device itself
        built = m.assigned_before(name, call)
        if not built or not isinstance(built[-1].value, ast.Call):
            continue  # the model comes from elsewhere (an argument, a global): cannot tell
        source = built[-1].value
        if m.callee(source).rpartition(".")[2] in _COPIES:
            continue  # a copy of another model: placed wherever that one is
        if any(pos(c) < pos(call) for arg in names_in(source) for c in _moves(m, arg, scope)):
            continue  # convert_sync_batchnorm(model_gpu): built from a model that was moved
        if any(_DEVICE_WORD.search(w) for w in _words(source)) or _built_on_device(m, built[-1]):
            continue  # build_model(cfg, device) / Model(device=...)
        ids = kwarg(call, "device_ids")
        has_ids = kind == "ddp" and ids is not None and not is_const(ids, None)
        if has_ids or m.uses_devices(scope):
            why = "device_ids is given" if has_ids else "the script places its tensors on a device"
            yield Hit(
                call,
                f"{wrapper} wraps `{name}` (built at line {built[-1].lineno}), which is never moved to "
                f"a device although {why}: its parameters stay on the CPU",
            )


def _words(expr: ast.AST) -> Iterator[str]:
    for n in ast.walk(expr):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.keyword) and n.arg:
            yield n.arg
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


_WEIGHTED_LOSSES = {
    "CrossEntropyLoss": 0,
    "NLLLoss": 0,
    "BCELoss": 0,
    "BCEWithLogitsLoss": 0,
    "MultiLabelSoftMarginLoss": 0,
    "MultiMarginLoss": 2,
}


def _tensor_unmoved(m: Module, expr: ast.expr, scope: ast.AST, before: ast.AST) -> bool:
    """``expr`` is a tensor built on the CPU: a torch factory call without device=, or a name bound to one."""
    if any(
        isinstance(n, ast.Call) and (is_device_move(n) or kwarg(n, "device") is not None)
        for n in ast.walk(expr)
    ):
        return False
    if isinstance(expr, ast.Call):
        return m.qualname(expr.func).startswith("torch.")
    if isinstance(expr, ast.Name):
        bound = m.assigned_before(expr.id, before)
        if not bound or _moves(m, expr.id, scope):
            return False
        value = bound[-1].value
        return value is not None and _tensor_unmoved(m, value, scope, bound[-1])
    return False


@rule(
    "loss-not-on-device",
    "PTL006",
    "error",
    "a loss module holding tensors (class weights) created on the CPU and never moved",
    "criterion = nn.CrossEntropyLoss(weight=w).to(device) (or build the weight with device=device)",
)
def loss_not_on_device(m: Module) -> Iterator[Hit]:
    """a loss function left on the CPU.

    Why: a loss module with tensors (``weight=``, ``pos_weight=``, or the parameters of
    ``AdaptiveLogSoftmaxWithLoss``) keeps them where they were built; the first loss on GPU outputs fails
    with "Expected all tensors to be on the same device ... cuda:0 and cpu". A loss without tensors
    (plain ``nn.CrossEntropyLoss()``) holds nothing and is not reported: it works on any device.
    Fix: ``.to(device)`` on the loss module, or build its tensors on the device.
    """
    for c in m.calls:
        name = m.callee(c).rpartition(".")[2]
        if not m.is_torch(c, *_WEIGHTED_LOSSES, "AdaptiveLogSoftmaxWithLoss"):
            continue
        scope = m.scope_of(c)
        if not m.uses_devices(scope):
            continue
        if name == "AdaptiveLogSoftmaxWithLoss":
            held: str = "parameters"
        else:
            index = _WEIGHTED_LOSSES[name]
            weight = kwarg(c, "weight") or kwarg(c, "pos_weight")
            if weight is None and len(c.args) > index:
                weight = c.args[index]
            if weight is None or is_const(weight, None) or not _tensor_unmoved(m, weight, scope, c):
                continue
            held = f"its `{ast.unparse(weight)}` tensor"
        parent = m.parents.get(c)
        outer = m.parents.get(parent) if isinstance(parent, ast.Attribute) else None
        if isinstance(outer, ast.Call) and is_device_move(outer):
            continue  # nn.CrossEntropyLoss(weight=w).to(device)
        if isinstance(parent, ast.Assign):
            targets = [d for t in parent.targets if (d := dotted(t))]
            if any(_moves(m, t, s) for t in targets for s in {scope, m.tree}):
                continue
        yield Hit(
            c,
            f"{name} keeps {held} on the CPU and is never moved to the device: the loss of GPU "
            "outputs fails with 'Expected all tensors to be on the same device'",
        )


def _single_process_branch(m: Module, node: ast.AST) -> bool:
    """Under ``if world_size == 1`` / ``if not ddp`` / ``x if distributed else "cuda:0"``: a fallback."""
    return any(
        isinstance(a, ast.If | ast.IfExp) and any(_DISTRIBUTED_TEST.search(w) for w in identifiers(a.test))
        for a in m.ancestors(node)
    )


def _hardcoded_devices(m: Module) -> Iterator[tuple[ast.AST, str]]:
    for n in m.nodes:
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and _CUDA_INDEX.match(n.value):
            parent = m.parents.get(n)
            if isinstance(parent, ast.Dict | ast.Compare | ast.JoinedStr | ast.Expr):
                continue  # map_location={"cuda:0": ...} remaps; comparisons and docstrings name, not place
            yield n, repr(n.value)
        elif isinstance(n, ast.Call):
            callee = m.callee(n)
            index = kwarg(n, "index") if callee == "torch.device" else None
            if callee == "torch.device" and len(n.args) > 1:
                index = n.args[1]
            elif callee.endswith("cuda.set_device") or (
                isinstance(n.func, ast.Attribute) and n.func.attr == "cuda" and callee != "torch.cuda"
            ):
                index = n.args[0] if n.args else kwarg(n, "device")
            if isinstance(index, ast.Constant) and type(index.value) is int:
                yield n, ast.unparse(n)
            ids = kwarg(n, "device_ids")
            if isinstance(ids, ast.List | ast.Tuple) and any(
                isinstance(e, ast.Constant) and type(e.value) is int for e in ids.elts
            ):
                yield ids, f"device_ids={ast.unparse(ids)}"


@rule(
    "hardcoded-device",
    "PTL007",
    "error",
    'a literal device index ("cuda:0", torch.device("cuda", 0), .cuda(0)) where LOCAL_RANK belongs',
    'local_rank = int(os.environ["LOCAL_RANK"]); device = torch.device(f"cuda:{local_rank}")',
)
def hardcoded_device(m: Module) -> Iterator[Hit]:
    """a hard-coded GPU index in a multi-process script.

    Why: every rank then uses GPU 0: out of memory there, the other GPUs idle, and NCCL may refuse two
    ranks on one device. Only reported in scripts that start a process group or read torchrun's variables
    (a single-process script may use "cuda:0"), not under a rank condition, and not when the script sets
    ``CUDA_VISIBLE_DEVICES`` itself (then "cuda:0" is each process's own GPU). ``map_location`` dicts that
    remap "cuda:0" are not reported.
    Fix: derive the device from ``LOCAL_RANK``.
    """
    if not m.is_distributed:
        return
    if any(isinstance(n, ast.Constant) and n.value == "CUDA_VISIBLE_DEVICES" for n in m.nodes):
        return
    for node, text in _hardcoded_devices(m):
        if m.rank_guarded(node) or _single_process_branch(m, node):
            continue
        yield Hit(
            node,
            f"{text} puts every rank on the same GPU: with N processes per node all of them use "
            "that device (OOM there, the others idle)",
        )
