"""Rules about the model's replicas: BatchNorm statistics, identical initialization, unused-parameter scan."""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator

from .analysis import Module
from .astutil import dotted, identifiers, is_const, kwarg, pos
from .registry import Hit, rule
from .values import bound_values, rank_dependent

_BATCHNORMS = (
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "LazyBatchNorm1d",
    "LazyBatchNorm2d",
    "LazyBatchNorm3d",
)
# torch.nn layers with randomly initialized parameters (norm layers start at ones/zeros: not random).
_RANDOM_LAYERS = frozenset(
    [
        "Linear",
        "Bilinear",
        "LazyLinear",
        "Conv1d",
        "Conv2d",
        "Conv3d",
        "ConvTranspose1d",
        "ConvTranspose2d",
        "ConvTranspose3d",
        "LazyConv1d",
        "LazyConv2d",
        "LazyConv3d",
        "Embedding",
        "EmbeddingBag",
        "RNN",
        "LSTM",
        "GRU",
        "Transformer",
        "TransformerEncoder",
        "TransformerDecoder",
        "TransformerEncoderLayer",
        "TransformerDecoderLayer",
        "MultiheadAttention",
        "Sequential",
        "ModuleList",
        "ModuleDict",
    ]
)
_PRETRAINED = re.compile(r"from_pretrained|load|checkpoint", re.IGNORECASE)
_LOADS = frozenset({"load_state_dict", "set_model_state_dict", "set_state_dict", "load"})
_BROADCASTS = frozenset({"broadcast", "broadcast_parameters", "_sync_module_states", "sync_module_states"})
_BUILTINS = frozenset(dir(builtins))
_NOT_TORCH_SEEDS = ("random.seed", "numpy.random.seed", "np.random.seed", "random.Random")


def _ddp_calls(m: Module) -> list[ast.Call]:
    return [c for c, kind in m.wrapper_calls() if kind == "ddp"]


@rule(
    "batchnorm-not-synced",
    "PTL005",
    "warning",
    "BatchNorm in a model wrapped in DDP, without convert_sync_batchnorm",
    "model = nn.SyncBatchNorm.convert_sync_batchnorm(model) before model.to(device) and DDP(...)",
)
def batchnorm_not_synced(m: Module) -> Iterator[Hit]:
    """Plain BatchNorm under DDP.

    Why: each rank normalizes with the mean and variance of its own local batch and keeps its own running
    statistics (DDP broadcasts rank 0's buffers every forward, so the others' are thrown away); with small
    per-GPU batches the result differs from single-GPU training or diverges. It is a warning: with large
    per-GPU batches per-rank statistics are a deliberate, common choice.
    One finding per file, at the first BatchNorm layer: converting is one decision for the whole model.
    Fix: ``nn.SyncBatchNorm.convert_sync_batchnorm(model)`` before wrapping.
    """
    ddp = _ddp_calls(m)
    if not ddp or m.calls_to("convert_sync_batchnorm"):
        return
    if any(
        w == "SyncBatchNorm"
        for n in m.nodes
        if isinstance(n, ast.Attribute | ast.Name)
        for w in identifiers(n)
    ):
        return
    layers = [c for c in m.calls if m.is_torch(c, *_BATCHNORMS)]
    if layers:  # one decision (convert the model or not): one finding, at the first layer
        more = (
            f" (and {len(layers) - 1} more BatchNorm layer{'s' if len(layers) > 2 else ''})"
            if len(layers) > 1
            else ""
        )
        yield Hit(
            layers[0],
            f"{m.callee(layers[0]).rpartition('.')[2]}{more} in a script that wraps its model in DDP (line "
            f"{ddp[0].lineno}): each rank normalizes with its own local batch statistics",
        )


@rule(
    "find-unused-parameters",
    "PTL010",
    "warning",
    "find_unused_parameters=True",
    "drop find_unused_parameters=True when every parameter gets a gradient in every forward "
    "(or use static_graph=True for a fixed set of unused ones)",
)
def find_unused_parameters(m: Module) -> Iterator[Hit]:
    """``find_unused_parameters=True`` without need.

    Why: DDP then walks the autograd graph after every forward to mark parameters that will get no
    gradient: extra time every step, and buckets that cannot start all-reducing early. Only models with
    parameters unused in some forwards (dynamic graphs, multi-task heads) need it. A warning: the linter
    cannot see whether this model does; silence it with ``# paratrain: ignore[find-unused-parameters]``.
    Fix: leave the default (False).
    """
    for c in _ddp_calls(m):
        flag = kwarg(c, "find_unused_parameters")
        if is_const(flag, True):
            assert flag is not None
            yield Hit(
                flag,
                "find_unused_parameters=True makes DDP traverse the autograd graph after every "
                "forward and delays gradient all-reduce; it is only needed when some parameters "
                "get no gradient",
            )


# -- unseeded-init ----------------------------------------------------------------------------------------


def _seeds_torch(m: Module, call: ast.Call) -> bool:
    """``torch.manual_seed``, ``seed_everything``, ``set_seed``, ``paratrain.init()`` (unless seed=None).

    Not ``random.seed``/``np.random.seed`` (torch's RNG is untouched) nor ``torch.cuda.manual_seed*`` (the
    CPU RNG that initializes CPU-built models is not).
    """
    full = m.callee(call)
    if full in ("paratrain.init", "paratrain.runtime.init"):
        return not is_const(kwarg(call, "seed"), None)
    last = full.rpartition(".")[2]
    if "seed" in last.lower():
        if any(rank_dependent(m, a, call) for a in [*call.args, *(k.value for k in call.keywords)]):
            return False  # manual_seed(rank), seed = seed + rank: every rank its own weights, the bug itself
        return not (full in _NOT_TORCH_SEEDS or full.startswith("torch.cuda.") or last == "initial_seed")
    return False


def _seed_calls(m: Module) -> list[ast.Call]:
    """Calls that seed torch: directly, or through functions of this file that do (computed once per file)."""
    if "seed_calls" not in m.memo:
        direct = [c for c in m.calls if _seeds_torch(m, c)]
        direct_set = set(direct)
        # functions that seed, directly or through each other: a worklist over who calls whom (linear)
        callers: dict[str, set[str]] = {}
        seeding: set[str] = set()
        for name, inner in m.function_calls.items():
            for c in inner:
                if c in direct_set:
                    seeding.add(name)
                elif isinstance(c.func, ast.Name):
                    callers.setdefault(c.func.id, set()).add(name)
        todo = list(seeding)
        while todo:
            for caller in callers.get(todo.pop(), ()):
                if caller not in seeding:
                    seeding.add(caller)
                    todo.append(caller)
        via = [c for c in m.calls if isinstance(c.func, ast.Name) and c.func.id in seeding]
        m.memo["seed_calls"] = sorted({*direct, *via}, key=pos)
    calls: list[ast.Call] = m.memo["seed_calls"]
    return calls


def seeded_before(m: Module, node: ast.AST, depth: int = 0) -> bool:
    """A same-on-every-rank torch seed is set on the way to ``node``: earlier in its scope, at module level,
    or before every caller."""
    scope = m.scope_of(node)
    seeds = _seed_calls(m)
    if any(m.scope_of(c) is scope and pos(c) < pos(node) for c in seeds):
        return True
    if scope is m.tree:
        return False
    if any(m.scope_of(c) is m.tree and _seeds_torch(m, c) for c in seeds):
        # module-level code runs at import, before any function is called; a module-level call of a
        # function that seeds (`main()`) is judged through the call sites below, in source order
        return True
    func = m.enclosing_function(node)
    sites = m.call_sites(func) if func is not None and depth < 4 else []
    if not sites:
        return bool(seeds)  # called from elsewhere: trust a seed anywhere in the file
    return all(seeded_before(m, s, depth + 1) for s in sites)


def _module_classes(m: Module) -> frozenset[str]:
    """Classes of this file that subclass nn.Module (directly or through another class of the file)."""
    found: set[str] = set()
    classes = [n for n in m.nodes if isinstance(n, ast.ClassDef)]
    changed = True
    while changed:
        changed = False
        for cls in classes:
            if cls.name in found:
                continue
            bases = [(dotted(b) or "").rpartition(".")[2] for b in cls.bases]
            if any(b == "Module" or b in found for b in bases):
                found.add(cls.name)
                changed = True
    return frozenset(found)


def _builds_model(m: Module, call: ast.Call, classes: frozenset[str]) -> bool:
    while isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Call):
        call = call.func.value  # nn.Linear(4, 4).to(device).float(): the innermost call builds
    full = m.callee(call)
    if m.is_torch(call, *_RANDOM_LAYERS) or (isinstance(call.func, ast.Name) and call.func.id in classes):
        return True
    if full.startswith("torchvision.models."):
        weights = kwarg(call, "weights") or kwarg(call, "pretrained")
        return weights is None or is_const(weights, None) or is_const(weights, False)
    return False


def _wrapper_kind(m: Module, call: ast.Call, kind: str) -> str:
    """``"broadcast"`` when the wrapper copies rank 0's parameters to every rank, ``"tp"`` for a TP plan
    (rank 0's values are scattered into the planned layers only), else ``"shard"``."""
    if kind in ("tp", "broadcast"):
        return kind
    if kind == "ddp":
        return "broadcast"
    if kind == "fsdp" and is_const(kwarg(call, "sync_module_states"), True):
        return "broadcast"
    strategy = kwarg(call, "strategy")
    if kind == "paratrain" and isinstance(strategy, ast.Constant) and strategy.value in ("ddp", "dp"):
        return "broadcast"
    return "shard"


def imports_from(m: Module, *packages: str) -> bool:
    """The file imports one of ``packages`` (``accelerate``, ``lightning``...)."""
    return any(v.split(".", 1)[0] in packages for v in m.aliases.values())


def framework_wrappers(m: Module) -> list[ast.Call]:
    """Calls that hand a model (and loaders) to a framework that wraps, broadcasts and shards them:
    ``deepspeed.initialize``, Accelerate's ``accelerator.prepare``, Fabric's ``setup``/``setup_module``/
    ``setup_dataloaders``, a Lightning ``Trainer``'s ``fit``."""
    if "framework_wrappers" not in m.memo:
        found = [c for c in m.calls_to("initialize") if m.callee(c).startswith("deepspeed.")]
        if imports_from(m, "accelerate"):
            found += m.calls_to("prepare", "prepare_model", "prepare_data_loader")
        if imports_from(m, "lightning", "pytorch_lightning", "lightning_fabric"):
            found += m.calls_to("setup", "setup_module", "setup_dataloaders", "fit")
        m.memo["framework_wrappers"] = sorted(found, key=pos)
    calls: list[ast.Call] = m.memo["framework_wrappers"]
    return calls


def _wrappers(m: Module) -> list[tuple[ast.Call, str]]:
    """Every call that wraps a model for several ranks, with its kind (``"broadcast"``...), in order."""
    found: list[tuple[ast.Call, str]] = list(m.wrapper_calls())
    found += [
        (c, "paratrain") for c in m.calls if m.callee(c) in ("paratrain.setup", "paratrain.parallel.setup")
    ]
    found += [(c, "tp") for c in m.calls_to("parallelize_module", "distribute_module")]
    found += [(c, "broadcast") for c in framework_wrappers(m)]
    return sorted(((c, _wrapper_kind(m, c, k)) for c, k in found), key=lambda w: pos(w[0]))


def _models(m: Module) -> Iterator[tuple[str, ast.Assign | ast.AnnAssign, ast.Call | None, str]]:
    """(name, the statement that builds it, the wrapper call or None, its kind) for each model seen."""
    seen: set[ast.AST] = set()
    wrappers = _wrappers(m)
    for call, kind in wrappers:
        arg = call.args[0] if call.args else kwarg(call, "module") or kwarg(call, "model")
        name = dotted(arg)
        if name is None:
            continue
        built = m.assigned_before(name, call)
        # model = Net(); model = model.to(device); model = torch.compile(model): the first one builds it
        while built and name in {dotted(n) for n in ast.walk(built[-1].value or ast.Pass())}:
            built.pop()
        if built and built[-1] not in seen and isinstance(built[-1].value, ast.Call):
            seen.add(built[-1])
            yield name, built[-1], call, kind
    classes = _module_classes(m)
    for n in m.nodes:
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and n not in seen:
            scope = m.scope_of(n)
            if isinstance(m.parents.get(scope), ast.ClassDef) or isinstance(scope, ast.ClassDef):
                continue  # a layer defined inside a model class is part of that model's definition
            names = [d for t in n.targets if (d := dotted(t))]
            if names and _builds_model(m, n.value, classes):
                # not traced to a wrapper: it may still reach one through a function or class of the file
                broadcast = [w for w, k in wrappers if k == "broadcast"]
                anywhere = broadcast[0] if broadcast else (wrappers[0][0] if wrappers else None)
                yield names[0], n, anywhere, "maybe-broadcast" if broadcast else "maybe-shard"


def _overwritten(m: Module, name: str, after: ast.AST) -> bool:
    """The parameters are loaded or broadcast after being built: the initialization does not matter."""
    for c in m.calls_to(*_LOADS, *_BROADCASTS):
        if pos(c) <= pos(after):
            continue
        last = m.callee(c).rpartition(".")[2]
        words = set(identifiers(c)) | {d for n in ast.walk(c) if (d := dotted(n))}
        if last in _LOADS and name in words:
            return True
        if last in _BROADCASTS:
            loops = m.enclosing_loops(c)
            around = words | {
                w for loop in loops if isinstance(loop, ast.For) for w in identifiers(loop.iter)
            }
            if around & {name, "parameters", "named_parameters", "state_dict", "buffers"}:
                return True
    return False


def _handed_elsewhere(m: Module, name: str, after: ast.AST) -> bool:
    """``name`` is passed to a function or class this file does not define (``Trainer(model, ...)``), which
    may wrap or broadcast it: the file alone cannot tell."""
    for c in m.calls:
        if pos(c) <= pos(after) or m.callee(c).startswith(("torch.", "nn.")):
            continue
        f = c.func
        local = isinstance(f, ast.Name) and (f.id in m.local_names or f.id in _BUILTINS)
        if not local and any(dotted(a) == name for a in [*c.args, *(k.value for k in c.keywords)]):
            return True
    return False


def _plan_keys(m: Module, call: ast.Call) -> set[str] | None:
    """The first component of each key of a ``parallelize_module`` plan given as a dict literal."""
    plan = kwarg(call, "parallelize_plan") or (call.args[2] if len(call.args) > 2 else None)
    if isinstance(plan, ast.Name):
        values = bound_values(m, plan.id, call)
        plan = values[-1] if values else None
    if not isinstance(plan, ast.Dict) or not all(isinstance(k, ast.Constant) for k in plan.keys):
        return None
    return {str(k.value).split(".", 1)[0] for k in plan.keys if isinstance(k, ast.Constant)}


def _uncovered_layers(m: Module, call: ast.Call, built: ast.Call) -> list[str]:
    """Randomly initialized layers of the model's class (defined in this file) that the TP plan leaves out.

    Empty when the file cannot tell (the class or the plan is defined elsewhere, the plan is not a dict).
    """
    keys = _plan_keys(m, call)
    if keys is None or "*" in keys or not isinstance(built.func, ast.Name):
        return []
    classes = [n for n in m.nodes if isinstance(n, ast.ClassDef) and n.name == built.func.id]
    if len(classes) != 1:
        return []
    layers = []
    for n in ast.walk(classes[0]):
        if (
            isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call)
            and m.is_torch(n.value, *_RANDOM_LAYERS)
        ):
            for t in n.targets:
                name = dotted(t) or ""
                if name.startswith("self.") and name.count(".") == 1:
                    layers.append(name[5:])
    return [layer for layer in layers if layer not in keys]


@rule(
    "unseeded-init",
    "PTL008",
    "error",
    "a model built before any same-on-every-rank seed, with nothing that broadcasts it (or a TP plan that "
    "leaves random layers out)",
    "call torch.manual_seed(SEED) with the same SEED on every rank before building the model",
)
def unseeded_init(m: Module) -> Iterator[Hit]:
    """Different initialization per process.

    Why: each rank draws its own random weights; replicas that start apart and average gradients train a
    model that is none of them (divergence, irreproducible results). Reported as an error when nothing in
    the file wraps or broadcasts any model (a hand-written gradient all-reduce, say). Silent when the model
    reaches a wrapper that makes the start consistent: DDP, FSDP1 with ``sync_module_states``, and the
    frameworks' wrappers (``deepspeed.initialize``, ``accelerator.prepare``, Fabric's ``setup``, Lightning's
    ``fit``) broadcast rank 0's parameters; FSDP/``fully_shard`` keep one copy of each shard (each element
    drawn once, from the same distribution); ``parallelize_module`` scatters rank 0's values into the
    layers of its plan. A TP plan applied to a model whose class this file defines is checked for
    coverage: a randomly initialized layer the plan leaves out stays different per rank (a warning).
    A seed counts only when it is the same on every rank: ``seed = base + rank; manual_seed(seed)`` is
    traced through the assignments and does not count. Not reported: models loaded or broadcast after
    being built, models handed to a class or function of another file (``Trainer(model)``), and scripts
    that never start a process group.
    Fix: ``torch.manual_seed(seed)`` (same seed on all ranks) before the model is built.
    """
    if not m.is_distributed:
        return
    for name, stmt, wrapper, kind in _models(m):
        value = stmt.value
        assert isinstance(value, ast.Call)
        if _PRETRAINED.search(m.callee(value)) or _overwritten(m, name, stmt) or seeded_before(m, stmt):
            continue
        built = f"`{name}` is built before any seed that is the same on every rank"
        if wrapper is None:
            if _handed_elsewhere(m, name, stmt):
                continue
            yield Hit(
                value,
                f"{built} and is never broadcast or wrapped (no DDP/FSDP in this file): every rank "
                "starts from its own random weights and the replicas diverge",
            )
        elif kind == "tp":
            inner = value
            while isinstance(inner.func, ast.Attribute) and isinstance(inner.func.value, ast.Call):
                inner = inner.func.value
            uncovered = _uncovered_layers(m, wrapper, inner)
            if uncovered:
                yield Hit(
                    value,
                    f"{built}; parallelize_module (line {wrapper.lineno}) scatters rank 0's values into the "
                    f"layers of its plan, but {', '.join(uncovered)} (outside the plan) keep each rank's own "
                    "random initialization",
                    severity="warning",
                )
