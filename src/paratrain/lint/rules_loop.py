"""Rules about the training loop: data partitioning, epoch shuffling, accumulation, logged metrics.

The classic DDP pitfalls about data and accumulation, and metrics logged from one rank.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from .analysis import Module
from .astutil import REDUCING, dotted, identifiers, is_const, kwarg, names_in, pos, root_name
from .registry import Hit, rule
from .rules_model import framework_wrappers, imports_from

_ITERATORS = frozenset({"iter", "enumerate", "tqdm", "zip", "islice", "cycle", "chain", "next", "list"})
_MICRO = re.compile(r"accum|micro|chunk|split", re.IGNORECASE)
_EVAL = re.compile(r"val|test|eval", re.IGNORECASE)
_PER_RANK_DATA = re.compile(r"rank|shard|by_node|IterableDataset", re.IGNORECASE)
_OPTIMIZER = re.compile(r"optim|^opt(_|$)|scaler", re.IGNORECASE)
_METRIC = re.compile(r"correct|loss|acc|total|sum|hit|err|metric|sample|seen|score|count|num", re.IGNORECASE)
_RANK0_PRINT = re.compile(r"print0|print_rank_?0|rank_?zero|master_print|main_print|log0", re.IGNORECASE)
_PRINTS = frozenset(
    {"print", "info", "warning", "debug", "log", "add_scalar", "add_scalars", "log_metrics", "write"}
)


def _dataloader_arg(call: ast.Call, name: str, index: int) -> ast.expr | None:
    value = kwarg(call, name)
    if value is None and len(call.args) > index:
        value = call.args[index]
    return value


@rule(
    "no-distributed-sampler",
    "PTL003",
    "error",
    "a DataLoader with shuffle=True, or without a sampler, in a script that starts a process group",
    "sampler = DistributedSampler(dataset); DataLoader(dataset, batch_size=B, sampler=sampler) (no shuffle=)",
)
def no_distributed_sampler(m: Module) -> Iterator[Hit]:
    """no ``DistributedSampler``.

    Why: every rank then iterates the whole dataset (in its own shuffled order, or the same order): the
    ranks do not partition the data, so N processes do the work of one and the speed-up is zero.
    ``shuffle=True`` with a ``sampler`` is an error in DataLoader itself. Not reported: loaders built under
    a rank condition (evaluation on rank 0), ``shuffle=False`` given explicitly without a sampler (each rank
    reading everything, on purpose), datasets that are visibly per rank (``Subset(ds, idx[rank::n])``),
    loaders handed to a framework that shards them (``accelerator.prepare``, Fabric's
    ``setup_dataloaders``, ``deepspeed.initialize``) or returned by a Lightning ``*_dataloader`` hook,
    ``**kwargs``, and scripts that never start a process group.
    Fix: a ``DistributedSampler`` (or any per-rank sampler/batch_sampler) and no ``shuffle=``.
    """
    if not m.is_distributed:
        return
    prepared = _framework_prepared(m)
    for c in m.calls:
        if not m.is_torch(c, "DataLoader") or any(k.arg is None for k in c.keywords) or m.rank_guarded(c):
            continue
        if c in prepared or _lightning_hook(m, c):
            continue
        dataset = _dataloader_arg(c, "dataset", 0)
        if dataset is not None and _per_rank(m, dataset, c):
            continue
        shuffle = _dataloader_arg(c, "shuffle", 2)
        sampler = _dataloader_arg(c, "sampler", 3)
        batch_sampler = _dataloader_arg(c, "batch_sampler", 4)
        has_sampler = any(s is not None and not is_const(s, None) for s in (sampler, batch_sampler))
        if is_const(shuffle, True):
            extra = " (and DataLoader refuses shuffle=True together with a sampler)" if has_sampler else ""
            yield Hit(
                c,
                "DataLoader(shuffle=True) in a distributed script: every rank shuffles and reads the "
                f"whole dataset instead of its 1/N share{extra}",
            )
        elif not has_sampler and shuffle is None:
            yield Hit(
                c,
                "DataLoader without a sampler in a distributed script: every rank reads the whole "
                "dataset, so the ranks repeat each other's work",
            )


def _framework_prepared(m: Module) -> set[ast.Call]:
    """DataLoader calls whose loader reaches a framework call that shards it (directly or by name)."""
    out: set[ast.Call] = set()
    for w in framework_wrappers(m):
        names = {dotted(a) for a in [*w.args, *(k.value for k in w.keywords)]} - {None}
        for c in m.calls_to("DataLoader"):
            parent = m.parents.get(c)
            bound = isinstance(parent, ast.Assign) and any(dotted(t) in names for t in parent.targets)
            if bound or any(n is c for n in ast.walk(w)):
                out.add(c)
    return out


def _lightning_hook(m: Module, call: ast.Call) -> bool:
    """Inside ``train_dataloader``/``val_dataloader``...: Lightning adds the distributed sampler itself."""
    func = m.enclosing_function(call)
    return (
        func is not None
        and func.name.endswith("_dataloader")
        and imports_from(m, "lightning", "pytorch_lightning")
    )


def _per_rank(m: Module, dataset: ast.expr, before: ast.AST) -> bool:
    """The dataset splits itself across ranks, visibly: ``Subset(ds, idx[rank::n])``, ``shard``,
    ``split_dataset_by_node``, or an ``IterableDataset`` (which must do its own splitting)."""
    words = list(identifiers(dataset))
    if isinstance(dataset, ast.Name):
        for a in m.assignments(dataset.id, m.scope_of(before)):
            words += identifiers(a.value or ast.Pass())
    iterable = {
        n.name
        for n in m.nodes
        if isinstance(n, ast.ClassDef) and any("IterableDataset" in (dotted(b) or "") for b in n.bases)
    }
    return any(_PER_RANK_DATA.search(w) or w in iterable for w in words)


def _handles(m: Module, sampler: ast.Call) -> set[str]:
    """The names a DistributedSampler is reached by: its variable and the DataLoaders built on it."""
    out: set[str] = set()
    parent = m.parents.get(sampler)
    if isinstance(parent, ast.Assign):
        out |= {d for t in parent.targets if (d := dotted(t))}
    for c in m.calls:
        if not m.is_torch(c, "DataLoader"):
            continue
        inside = any(n is sampler for n in ast.walk(c))
        uses = any(dotted(n) in out for n in ast.walk(c) if isinstance(n, ast.Name | ast.Attribute))
        loader = m.parents.get(c)
        if (inside or uses) and isinstance(loader, ast.Assign):
            out |= {d for t in loader.targets if (d := dotted(t))}
    return out


@rule(
    "no-set-epoch",
    "PTL004",
    "error",
    "a DistributedSampler used in an epoch loop without set_epoch",
    "call sampler.set_epoch(epoch) at the start of every epoch, before iterating the loader",
)
def no_set_epoch(m: Module) -> Iterator[Hit]:
    """forgetting ``sampler.set_epoch(epoch)``.

    Why: DistributedSampler shuffles with ``seed + epoch``; its epoch stays 0 unless set, so every epoch
    visits the data in the first epoch's order (training stalls after epoch one). Reported when the sampler
    (or a DataLoader built on it) is iterated inside a loop nested in another loop (the epoch loop), or
    handed each epoch to a function of this file that iterates it, and no ``set_epoch`` is called on it (or
    on anything this file cannot tell apart from it). Not reported: ``shuffle=False`` samplers, evaluation
    loaders (``val``/``test``/``eval`` in the name: their order does not matter), and a sampler handed to a
    function defined in another file (which may call ``set_epoch``).
    Fix: ``sampler.set_epoch(epoch)`` each epoch.
    """
    samplers = [c for c in m.calls if m.is_torch(c, "DistributedSampler")]
    if not samplers:
        return
    handles = {id(s): _handles(m, s) for s in samplers}
    known = {h.split(".", 1)[0] for hs in handles.values() for h in hs}
    set_epochs = [
        root_name(c.func.value)
        for c in m.calls
        if isinstance(c.func, ast.Attribute) and c.func.attr == "set_epoch"
    ]
    for s in samplers:
        if is_const(_dataloader_arg(s, "shuffle", 3), False) or any(_EVAL.search(h) for h in handles[id(s)]):
            continue  # no shuffling, or an evaluation loader, whose order does not matter
        mine = {h.split(".", 1)[0] for h in handles[id(s)]}
        if any(r in mine or r not in known for r in set_epochs):
            continue
        parent = m.parents.get(s)
        own = [d for t in parent.targets if (d := dotted(t))] if isinstance(parent, ast.Assign) else []
        if _handed_out(m, set(own)):
            continue  # train(..., sampler=sampler) defined in another file may call set_epoch
        use = _epoch_loop_use(m, handles[id(s)])
        if use is not None:
            name = own[0] if own else f"{min(handles[id(s)], default='the loader')}.sampler"
            yield Hit(
                s,
                f"DistributedSampler used in an epoch loop (line {use.lineno}) without set_epoch(): "
                f"`{name}` shuffles with the same seed every epoch, so each epoch repeats the first "
                "one's order",
            )


def _local(m: Module, call: ast.Call) -> bool:
    """A call of a function defined in this file (``f(...)``, ``self.f(...)``)."""
    f = call.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    return name in m.functions and (isinstance(f, ast.Name) or dotted(f) in (f"self.{name}", f"cls.{name}"))


def _iterates(m: Module, call: ast.Call) -> bool:
    """The call iterates what it is given: ``iter(loader)``, ``tqdm(loader)``, or a function of this file
    (whose body the rule has seen: it calls no set_epoch on anything of this file)."""
    return m.callee(call).rpartition(".")[2] in _ITERATORS or _local(m, call)


def _handed_out(m: Module, names: set[str]) -> bool:
    """One of ``names`` is passed to a function defined elsewhere, which may call set_epoch on it."""
    for c in m.calls:
        if _iterates(m, c) or m.is_torch(c, "DataLoader", "BatchSampler", "DistributedSampler"):
            continue
        if any(dotted(a) in names for a in [*c.args, *(k.value for k in c.keywords)]):
            return True
    return False


def _epoch_loop_use(m: Module, handles: set[str]) -> ast.stmt | None:
    """The outer loop in which a handle is iterated by an inner loop, or passed to a call, if any."""
    for n in m.nodes:
        if not isinstance(n, ast.Name | ast.Attribute) or dotted(n) not in handles:
            continue
        if not isinstance(getattr(n, "ctx", None), ast.Load):
            continue
        loops = m.enclosing_loops(n)
        for a in m.ancestors(n):
            if isinstance(a, ast.For | ast.AsyncFor) and any(x is n for x in ast.walk(a.iter)):
                outer = m.enclosing_loops(a)
                if outer:
                    return outer[0]
                break
            if isinstance(a, ast.Call) and n is not a.func and loops and _iterates(m, a):
                return loops[0]
            if isinstance(a, ast.stmt):
                break
    return None


def _optimizer_steps(m: Module) -> list[ast.Call]:
    out = []
    for c in m.calls:
        if isinstance(c.func, ast.Attribute) and c.func.attr == "step":
            receiver = (dotted(c.func.value) or "").rpartition(".")[2]
            if _OPTIMIZER.search(receiver) and "sched" not in receiver.lower():
                out.append(c)
    return out


def _micro_step_loop(m: Module, loop: ast.AST) -> bool:
    """``for micro in range(k)``, ``for chunk in batch.chunk(k)``, a ``while``; not ``for m in (a, b)``."""
    if not isinstance(loop, ast.For | ast.AsyncFor):
        return True
    if isinstance(loop.iter, ast.Call) and m.callee(loop.iter) == "range":
        return True
    return any(_MICRO.search(w) for w in identifiers(loop.iter))


def _gated_by_accumulation(m: Module, node: ast.AST, loop: ast.AST) -> ast.If | None:
    for a in m.ancestors(node):
        if a is loop:
            return None
        if isinstance(a, ast.If):
            modulo = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(a.test))
            if modulo or any("accum" in w.lower() for w in identifiers(a.test)):
                return a
    return None


@rule(
    "accumulation-without-no-sync",
    "PTL009",
    "warning",
    "backward() called more often than optimizer.step() on a DDP model, with no no_sync()",
    "run the micro-steps that do not step the optimizer inside `with model.no_sync():`",
)
def accumulation_without_no_sync(m: Module) -> Iterator[Hit]:
    """gradient accumulation under DDP without ``no_sync()``.

    Why: DDP all-reduces the gradients in every ``backward()``; with accumulation only the last micro-step's
    all-reduce is needed, so the others are wasted communication (K times the traffic for K micro-steps).
    The result is still correct, hence a warning. Reported when, in a script that wraps a model in DDP and
    never mentions ``no_sync`` (nor ``require_backward_grad_sync``/``set_requires_gradient_sync``), a loop
    calls ``backward()`` every iteration but ``optimizer.step()`` only under an ``if step % k`` (or
    ``accum``) condition, or calls ``backward()`` in an inner loop and ``step()`` once after it.
    Fix: ``with model.no_sync():`` around the non-final micro-steps.
    """
    if not any(kind == "ddp" for _, kind in m.wrapper_calls()):
        return
    words = {w for n in m.nodes if isinstance(n, ast.Attribute | ast.Name) for w in identifiers(n)}
    if words & {"no_sync", "require_backward_grad_sync", "set_requires_gradient_sync", "accumulate"}:
        return
    steps = _optimizer_steps(m)
    backwards = [c for c in m.calls if isinstance(c.func, ast.Attribute) and c.func.attr == "backward"]
    for b in backwards:
        loops = m.enclosing_loops(b)
        if not loops:
            continue
        inner = loops[0]
        here = [s for s in steps if inner in m.enclosing_loops(s)]
        if here:
            gated = [(s, g) for s in here if (g := _gated_by_accumulation(m, s, inner)) is not None]
            if gated and all(g not in m.ancestors(b) for _, g in gated):
                s, g = gated[0]
                yield Hit(
                    b,
                    f"backward() runs every iteration but the optimizer steps only under `if "
                    f"{ast.unparse(g.test)}` (line {s.lineno}): DDP all-reduces the gradients in every "
                    "backward, wasting all but the last micro-step's all-reduce",
                )
        elif len(loops) > 1 and _micro_step_loop(m, inner):
            outer = loops[1]
            after = [s for s in steps if outer in m.enclosing_loops(s) and pos(s) > pos(inner)]
            if after:
                yield Hit(
                    b,
                    f"backward() runs in an inner loop (line {inner.lineno}) and the optimizer steps "
                    f"once after it (line {after[0].lineno}): DDP all-reduces the gradients in every "
                    "backward, wasting all but the last micro-step's all-reduce",
                )


def _reduced_names(m: Module) -> set[str]:
    """Names that reach a reducing collective: directly, through a tensor built from them, or a helper."""
    reducing_funcs = {
        name for name, calls in m.function_calls.items() if any(m.is_dist(c, *REDUCING) for c in calls)
    }
    out: set[str] = set()
    for c in m.calls:
        direct = m.is_dist(c, *REDUCING)
        helper = isinstance(c.func, ast.Name) and c.func.id in reducing_funcs
        if direct or helper:
            out |= {n for arg in [*c.args, *(k.value for k in c.keywords)] for n in names_in(arg)}
    changed = True
    while changed:  # t = torch.tensor([correct, total]); dist.all_reduce(t): correct and total are reduced
        changed = False
        for n in m.nodes:
            if isinstance(n, ast.Assign) and any(names_in(t) & out for t in n.targets):
                new = names_in(n.value) - out
                if new:
                    out |= new
                    changed = True
    return out


def _evaluation(m: Module, node: ast.AST) -> bool:
    """``node`` is part of an evaluation: in a function named like ``evaluate``/``test``/``validate``, in a
    loop over an evaluation loader (``val_loader``), or under ``torch.no_grad()``/``inference_mode()``."""
    func = m.enclosing_function(node)
    if func is not None and _EVAL.search(func.name):
        return True
    for a in m.ancestors(node):
        if isinstance(a, ast.For | ast.AsyncFor) and any(_EVAL.search(w) for w in identifiers(a.iter)):
            return True
        if isinstance(a, ast.With | ast.AsyncWith) and any(
            isinstance(i.context_expr, ast.Call)
            and m.callee(i.context_expr).rpartition(".")[2] in ("no_grad", "inference_mode")
            for i in a.items
        ):
            return True
        if isinstance(a, ast.FunctionDef | ast.AsyncFunctionDef):
            break
    return False


@rule(
    "unreduced-metric",
    "PTL016",
    "warning",
    "an evaluation metric printed on rank 0 from local counts that were never all-reduced (best effort)",
    "all-reduce the counts first: t = torch.tensor([correct, total], device=device); "
    "dist.all_reduce(t); correct, total = t.tolist()",
)
def unreduced_metric(m: Module) -> Iterator[Hit]:
    """An evaluation accuracy or loss printed on rank 0 from its own counts only.

    Why: with a DistributedSampler each rank evaluates 1/N of the data; rank 0's ``correct / total`` is the
    accuracy of its shard, reported as if it were the model's. Best effort, a warning: reported when, in a
    script that shards its data (a ``DistributedSampler``), a metric-like accumulator (``correct += ...``,
    ``val_loss += loss.item()``, not ``step += 1``) summed during an evaluation (a function named like
    ``evaluate``/``test``, a loop over a ``val``/``test`` loader, or under ``torch.no_grad()``), or a value
    computed from one, is printed or logged under a rank-0 condition (or by a ``print0``-like helper), and
    no reducing collective (``all_reduce``, ``reduce``, ``all_gather``..., or a helper of this file that
    calls one) ever receives it. One finding per function. Not reported: a running training loss (progress
    logging: every rank's is an unbiased sample), loaders without a sampler (each rank then sees all the
    data), and accumulation that itself runs only on rank 0.
    Fix: all-reduce the sums before dividing and printing.
    """
    if not m.is_distributed or not m.calls_to("DistributedSampler"):
        return
    reduced = _reduced_names(m)
    for scope in [m.tree, *(f for fs in m.functions.values() for f in fs)]:
        nodes = m.scope_nodes(scope)
        accumulators = {
            n.target.id
            for n in nodes
            if isinstance(n, ast.AugAssign)
            and isinstance(n.op, ast.Add)
            and isinstance(n.target, ast.Name)
            and _METRIC.search(n.target.id)
            and not isinstance(n.value, ast.Constant)
            and m.enclosing_loops(n)
            and _evaluation(m, n)
            and not m.rank_guarded(n)
        }
        if not accumulators - reduced:
            continue
        local = accumulators - reduced
        for n in nodes:  # acc = correct / total is as local as its inputs
            if isinstance(n, ast.Assign) and names_in(n.value) & local:
                local |= {t.id for t in n.targets if isinstance(t, ast.Name) and t.id not in reduced}
        shown: set[str] = set()
        first: ast.Call | None = None
        for c in nodes:
            if not isinstance(c, ast.Call):
                continue
            callee = m.callee(c)
            head, _, last = callee.rpartition(".")
            printer = last in _PRINTS and head.split(".", 1)[0] not in ("math", "numpy", "np", "torch")
            if not (_RANK0_PRINT.search(callee) or (printer and m.rank_guarded(c))):
                continue
            names = {n for arg in [*c.args, *(k.value for k in c.keywords)] for n in names_in(arg)} & local
            if names:
                shown |= names
                first = first or c
        if first is not None:  # one finding per function, naming every unreduced figure it reports
            yield Hit(
                first,
                f"rank 0 reports {', '.join(sorted(shown))} from its own shard only: never all-reduced, so "
                "the figure covers 1/N of the data",
            )
