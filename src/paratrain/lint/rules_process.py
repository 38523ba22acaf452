"""Rules about the process group's life: collectives every rank must reach, checkpoint I/O, setup, teardown.

Deadlocks, unsafe loads, every rank writing one file, a leaked process group, and a rendezvous address
written over torchrun's.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from .analysis import Module
from .astutil import COLLECTIVES, dotted, identifiers, is_const, kwarg, names_in
from .registry import Hit, rule

_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")
# Variables whose presence tells a torchrun launch from a plain `python train.py`.
_LAUNCHER_VARS = {*_RENDEZVOUS, "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
# Targets private to the process: in-memory buffers, temporary files.
_PRIVATE_FILE = re.compile(r"^(?:BytesIO|buffer|buf)$|tempfile|Temporary|mkstemp|mkdtemp")


def _on_subgroup(m: Module, call: ast.Call, op: str) -> bool:
    """The collective names a process group: only that group's members call it, by design."""
    group = kwarg(call, "group") or kwarg(call, "process_group")
    if group is None and len(call.args) > COLLECTIVES[op] and op not in ("barrier", "monitored_barrier"):
        group = call.args[COLLECTIVES[op]]
    if op in ("barrier", "monitored_barrier") and call.args:
        group = call.args[0]
    return group is not None and not is_const(group, None)


def _local_callee(call: ast.Call) -> str | None:
    """The name of a function of this file that ``call`` may call: ``f(...)``, ``self.f(...)``."""
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and dotted(f.value) in ("self", "cls"):
        return f.attr
    return None


def _collective_functions(m: Module) -> dict[str, set[str]]:
    """Functions of this file that issue collectives (directly or through each other): name -> ops.

    A worklist over the file's call graph: each function is revisited only when a callee gains an op, so
    a long chain of helpers costs linear, not quadratic, time.
    """
    if "collective_functions" in m.memo:
        cached: dict[str, set[str]] = m.memo["collective_functions"]
        return cached
    ops: dict[str, set[str]] = {}
    callers: dict[str, set[str]] = {}
    for name, calls in m.function_calls.items():
        ops[name] = set()
        for c in calls:
            op = m.is_dist(c, *COLLECTIVES)
            if op is not None and not _on_subgroup(m, c, op):
                ops[name].add(op)
            elif op is None and (callee := _local_callee(c)) is not None and callee != name:
                callers.setdefault(callee, set()).add(name)
    todo = [name for name, found in ops.items() if found]
    while todo:
        name = todo.pop()
        for caller in callers.get(name, ()):
            if caller in ops and not ops[name] <= ops[caller]:
                ops[caller] |= ops[name]
                todo.append(caller)
    result = {k: v for k, v in ops.items() if v}
    m.memo["collective_functions"] = result
    return result


def _ops_of(m: Module, call: ast.Call, functions: dict[str, set[str]]) -> set[str]:
    op = m.is_dist(call, *COLLECTIVES)
    if op is not None:
        return set() if _on_subgroup(m, call, op) else {op}
    callee = _local_callee(call)
    return functions.get(callee, set()) if callee is not None else set()


def _branch_ops(m: Module, body: list[ast.stmt], functions: dict[str, set[str]]) -> set[str]:
    """The collectives a branch issues on every path: a nested ``if`` counts only for ops in both arms.

    Loops and ``with``/``try`` bodies are taken as run (lenient: a loop over parameters that all-reduces
    each gradient matches the other branch's all_reduce).
    """
    out: set[str] = set()
    for stmt in body:
        if isinstance(stmt, ast.If):
            out |= _ops_of_expr(m, stmt.test, functions)
            out |= _branch_ops(m, stmt.body, functions) & _branch_ops(m, stmt.orelse, functions)
        elif not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out |= _ops_of_expr(m, stmt, functions)
    return out


def _plain_rank_test(test: ast.expr) -> bool:
    """``rank != 0``, ``not is_main``, ``get_rank() > 0``: not a compound or a membership test.

    ``if members is not None and rank not in members: return`` is how a subgroup's non-members leave;
    what follows runs on the subgroup, so an early exit is judged only on a plain rank test.
    """
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    if isinstance(test, ast.Compare):
        return not any(isinstance(op, ast.In | ast.NotIn) for op in test.ops)
    return isinstance(test, ast.Name | ast.Attribute | ast.Call)


def _rank_ifs(m: Module, node: ast.AST) -> Iterator[tuple[ast.If | ast.IfExp, bool]]:
    """Each rank ``if`` around ``node`` in its scope, with whether ``node`` is in its ``body`` branch."""
    child = node
    for a in m.ancestors(node):
        if isinstance(a, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef | ast.Module):
            return
        if isinstance(a, ast.If | ast.IfExp) and child is not a.test and m.is_rank_test(a.test):
            in_body = child is a.body if isinstance(a, ast.IfExp) else child in a.body
            yield a, in_body
        child = a


_FLIP = {
    "==": "!=",
    "!=": "==",
    "<": ">=",
    ">=": "<",
    ">": "<=",
    "<=": ">",
    "truthy": "falsy",
    "falsy": "truthy",
}
_SWAP = {"==": "==", "!=": "!=", "<": ">", ">": "<", "<=": ">=", ">=": "<="}
_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}


def _predicate(test: ast.expr, negated: bool = False) -> tuple[str, str, str] | None:
    """``test`` (or its negation) as ``(subject, op, value)``, normalised for ranks (never negative, so
    ``r > 0`` and ``r >= 1`` are ``r != 0``, ``r < 1`` and ``r <= 0`` are ``r == 0``); ``None`` when it is
    not a single comparison or a plain truth test."""
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, negated = test.operand, not negated
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _OPS:
        op, left, right = _OPS[type(test.ops[0])], test.left, test.comparators[0]
        if isinstance(left, ast.Constant) and not isinstance(right, ast.Constant):
            left, right, op = right, left, _SWAP[op]
        if not isinstance(right, ast.Constant):
            return None
        pred = (ast.unparse(left), op, repr(right.value))
    elif isinstance(test, ast.Name | ast.Attribute | ast.Call):
        pred = (ast.unparse(test), "truthy", "")
    else:
        return None
    return _normal(_negate(pred) if negated else pred)


def _negate(pred: tuple[str, str, str]) -> tuple[str, str, str]:
    return _normal((pred[0], _FLIP[pred[1]], pred[2]))


def _normal(pred: tuple[str, str, str]) -> tuple[str, str, str]:
    subject, op, value = pred
    if (op, value) in ((">", "0"), (">=", "1")):
        return subject, "!=", "0"
    if (op, value) in (("<=", "0"), ("<", "1")):
        return subject, "==", "0"
    return pred


@rule(
    "rank-conditional-collective",
    "PTL011",
    "error",
    "a collective (all_reduce, barrier, broadcast, ...) reached by some ranks only, as under `if rank == 0:`",
    "call the collective on every rank (outside the rank condition, or in both branches); keep only the "
    "printing/saving under the condition",
)
def rank_conditional_collective(m: Module) -> Iterator[Hit]:
    """A collective under a rank condition is a deadlock.

    Why: a collective completes only when every rank of the group has called it; the ranks that skip it
    move on to the next collective (mismatched, or corrupt data) or exit, and the others wait until the
    timeout (NCCL's default is 10 minutes, torchrun's hang looks like a frozen job). Reported for a
    ``torch.distributed`` collective (or a function of this file that issues one) inside an ``if`` whose
    test mentions the rank (``rank == 0``, ``get_rank()``, ``local_rank``, ``is_main``...) when the other
    branch does not issue the same collective, and after an early ``if <rank test>: return``. Not
    reported: send/recv (point-to-point by design), collectives on an explicit ``group=``, an early exit
    on a compound or membership test (how a subgroup's non-members leave), and the paired "rank 0 first"
    pattern (two separate rank ``if`` s issuing the same op in one function, e.g.
    ``if rank != 0: barrier()`` ... ``if rank == 0: barrier()``).
    Fix: every rank calls the collective; only the rank-specific work stays under the condition.
    """
    functions = _collective_functions(m)
    # (call, its ops, the guard, where, the condition under which the call runs)
    sites: list[tuple[ast.Call, set[str], ast.AST, str, tuple[str, str, str] | None]] = []
    for c in m.calls:
        ops = _ops_of(m, c, functions)
        if not ops:
            continue
        for cond, in_body in _rank_ifs(m, c):
            other = cond.orelse if in_body else cond.body
            other_ops = (
                _branch_ops(m, other, functions)
                if isinstance(other, list)
                else _ops_of_expr(m, other, functions)
            )
            if not ops & other_ops:
                where = f"`if {ast.unparse(cond.test)}` (line {cond.lineno})"
                sites.append((c, ops, cond, where, _predicate(cond.test, negated=not in_body)))
                break
        else:
            exit_if = m.early_exit(c)
            if (
                exit_if is not None
                and _plain_rank_test(exit_if.test)
                and not ops & _branch_ops(m, exit_if.body, functions)
            ):
                sites.append(
                    (
                        c,
                        ops,
                        exit_if,
                        f"the early exit `if {ast.unparse(exit_if.test)}` (line {exit_if.lineno})",
                        _predicate(exit_if.test, negated=True),  # past the exit: its test was false
                    )
                )
    # index the sites by (scope, op, condition): finding a complementary partner is a lookup, not a scan
    by_key: dict[tuple[int, str, tuple[str, str, str]], list[tuple[ast.Call, ast.AST]]] = {}
    for c, ops, guard, _, pred in sites:
        if pred is not None:
            for op in ops:
                by_key.setdefault((id(m.scope_of(c)), op, pred), []).append((c, guard))
    for c, ops, guard, where, pred in sites:
        # the "rank 0 first" pattern: the same op under the complementary condition elsewhere in the scope
        # (`if rank != 0: barrier()` ... `if rank == 0: barrier()`); every rank calls it once
        paired = pred is not None and any(
            o is not c and oc is not guard and oc not in m.ancestors(guard) and guard not in m.ancestors(oc)
            for op in ops
            for o, oc in by_key.get((id(m.scope_of(c)), op, _negate(pred)), [])
        )
        if paired:
            continue
        what = (
            f"dist.{next(iter(sorted(ops)))}"
            if m.is_dist(c, *COLLECTIVES)
            else (f"{ast.unparse(c.func)}() (which calls {', '.join(sorted(ops))})")
        )
        yield Hit(
            c,
            f"{what} is reached on some ranks only, because of {where}: the other ranks never "
            "call it and the job deadlocks (or mismatches collectives)",
        )


def _ops_of_expr(m: Module, expr: ast.AST, functions: dict[str, set[str]]) -> set[str]:
    return {op for c in ast.walk(expr) if isinstance(c, ast.Call) for op in _ops_of(m, c, functions)}


@rule(
    "unsafe-torch-load",
    "PTL012",
    "warning",
    "torch.load without weights_only=True (error when weights_only=False)",
    "torch.load(path, map_location=..., weights_only=True); keep non-tensor state in JSON",
    tier="hygiene",
)
def unsafe_torch_load(m: Module) -> Iterator[Hit]:
    """``torch.load`` that may unpickle arbitrary objects (TorchFix's TOR102 too). Hygiene tier (opt-in).

    Why: a pickle runs code when it is loaded; a checkpoint from anywhere else (a shared filesystem, a
    download) can execute anything in every rank. ``weights_only=True`` restricts loading to tensors and
    plain containers. Since torch 2.6 that is the default, so an omitted argument is a warning (the script
    is unsafe on older torch, and the intent is not visible); ``weights_only=False`` is an error.
    A non-literal value (``weights_only=trusted``) is not reported.
    Opt-in because in training scripts it almost always loads a checkpoint the same script wrote, and on
    torch >= 2.6 the omitted argument already means ``weights_only=True``: on real scripts it was the most
    frequent finding and almost never a mistake.
    Fix: ``weights_only=True``.
    """
    for c in m.calls:
        if m.callee(c) not in ("torch.load", "torch.serialization.load") or any(
            k.arg is None for k in c.keywords
        ):
            continue
        flag = kwarg(c, "weights_only")
        if flag is None:
            yield Hit(
                c,
                "torch.load without weights_only=True unpickles arbitrary objects on torch < 2.6 (a "
                "checkpoint can run code in every rank); say weights_only=True",
            )
        elif is_const(flag, False):
            yield Hit(
                flag,
                "torch.load(weights_only=False) unpickles arbitrary objects: a checkpoint can run "
                "code in every rank",
                severity="error",
            )


def _per_rank_target(m: Module, target: ast.expr | None) -> bool:
    """The file name has the rank in it (a per-rank file), or the target is an in-memory buffer."""
    if target is None:
        return False
    if m.is_rank_test(target):
        return True
    words = list(identifiers(target))
    for name in names_in(target):
        for a in m.assignments(name, m.scope_of(target)):
            words += identifiers(a.value or ast.Pass())
        for n in m.scope_nodes(m.scope_of(target)):  # with tempfile.NamedTemporaryFile() as tmp:
            if (
                isinstance(n, ast.withitem)
                and isinstance(n.optional_vars, ast.Name)
                and n.optional_vars.id == name
            ):
                words += identifiers(n.context_expr)
    return any(_PRIVATE_FILE.search(w) for w in words) or any(m.is_rank_test(ast.Name(w)) for w in words)


@rule(
    "save-on-every-rank",
    "PTL013",
    "error",
    "torch.save not guarded by a rank check, for a non-sharded state",
    "save on one rank: if dist.get_rank() == 0: torch.save(...), then dist.barrier() before anyone reads it "
    "(or save sharded state with torch.distributed.checkpoint)",
)
def save_on_every_rank(m: Module) -> Iterator[Hit]:
    """Every rank writing the same checkpoint file.

    Why: N processes open, truncate and write one path at once: a torn or corrupted file on shared storage,
    N times the I/O, and a reader may see a half-written file. Reported for ``torch.save`` in a distributed
    script that is not under a rank condition (``if rank == 0``, ``is_main``, an early ``if rank != 0:
    return``, a ``@rank_zero_only`` function, or a function of this file called only under one). Not
    reported: per-rank files (the rank in the path), in-memory buffers, functions never called in this file,
    and sharded saves (``torch.distributed.checkpoint.save``/``dcp.save`` are collective by design).
    Fix: guard the save with a rank check.
    """
    if not m.is_distributed:
        return
    for c in m.calls:
        if m.callee(c) != "torch.save":
            continue
        target = c.args[1] if len(c.args) > 1 else kwarg(c, "f")
        obj = c.args[0] if c.args else kwarg(c, "obj")
        if _per_rank_target(m, target) or (
            obj is not None and any("shard" in w.lower() for w in identifiers(obj))
        ):
            continue
        if m.rank_guarded(c):
            continue
        func = m.enclosing_function(c)
        if func is not None and not m.call_sites(func) and m.scope_of(c) is not m.tree:
            continue  # a helper called from elsewhere: cannot tell
        yield Hit(
            c,
            "torch.save runs on every rank: all ranks write the same file at once (a torn checkpoint "
            "on shared storage, N times the I/O)",
        )


@rule(
    "no-destroy-process-group",
    "PTL014",
    "warning",
    "init_process_group without destroy_process_group",
    "call dist.destroy_process_group() once training is done (in a finally: block so errors clean up too)",
    tier="hygiene",
)
def no_destroy_process_group(m: Module) -> Iterator[Hit]:
    """A process group that is never destroyed. Hygiene tier (opt-in): the process usually exits right
    after training, which releases everything.

    Why: the communicator's threads and sockets outlive the training; NCCL warns at exit that the process
    group was not destroyed, pending work can hang the exit, and a process that inits again fails. Reported
    when the file calls ``init_process_group`` and never mentions ``destroy_process_group``.
    Fix: ``dist.destroy_process_group()`` at the end (in ``finally:``).
    """
    if not m.init_calls:
        return
    if any(
        "destroy_process_group" in identifiers(n) for n in m.nodes if isinstance(n, ast.Name | ast.Attribute)
    ):
        return
    yield Hit(
        m.init_calls[0],
        "init_process_group without destroy_process_group: the process group's "
        "threads and connections are never released (NCCL warns at exit; it may hang)",
    )


def _torchrun_script(m: Module) -> bool:
    """Launched by torchrun: reads its variables, or inits from the env:// default (no rank= given)."""
    if m.spawns:
        return False
    if m.reads_rank_env:
        return True
    for c in m.init_calls:
        method = kwarg(c, "init_method")
        env = method is None or (isinstance(method, ast.Constant) and str(method.value).startswith("env://"))
        if env and kwarg(c, "rank") is None and kwarg(c, "store") is None and len(c.args) < 5:
            return True
    return False


def _literal(expr: ast.AST | None) -> bool:
    """A constant, ``str(constant)``, or an f-string without placeholders."""
    if isinstance(expr, ast.Constant):
        return True
    if isinstance(expr, ast.Call) and dotted(expr.func) == "str" and len(expr.args) == 1:
        return _literal(expr.args[0])
    return isinstance(expr, ast.JoinedStr) and all(isinstance(v, ast.Constant) for v in expr.values)


def _rendezvous_writes(m: Module) -> Iterator[tuple[ast.AST, str]]:
    for n in m.nodes:
        if isinstance(n, ast.Assign) and _literal(n.value):
            for t in n.targets:
                if isinstance(t, ast.Subscript) and "environ" in (dotted(t.value) or ""):
                    key = t.slice
                    if isinstance(key, ast.Constant) and key.value in _RENDEZVOUS:
                        yield n, str(key.value)
        elif isinstance(n, ast.Call):
            callee = m.callee(n)
            if callee.endswith("environ.update"):
                if n.args and isinstance(n.args[0], ast.Dict):
                    for k, v in zip(n.args[0].keys, n.args[0].values, strict=True):
                        if isinstance(k, ast.Constant) and k.value in _RENDEZVOUS and _literal(v):
                            yield n, str(k.value)
                for kw in n.keywords:  # os.environ.update(MASTER_ADDR="10.0.0.1")
                    if kw.arg in _RENDEZVOUS and _literal(kw.value):
                        yield n, kw.arg
            elif (
                callee in ("os.putenv", "putenv")
                and len(n.args) == 2
                and isinstance(n.args[0], ast.Constant)
                and n.args[0].value in _RENDEZVOUS
                and _literal(n.args[1])
            ):
                yield n, str(n.args[0].value)


@rule(
    "hardcoded-rendezvous",
    "PTL015",
    "error",
    "a literal MASTER_ADDR or MASTER_PORT written into os.environ in a torchrun script",
    "delete the assignment: torchrun sets MASTER_ADDR/MASTER_PORT (--rdzv-endpoint, --master-port); "
    "use os.environ.setdefault(...) for a default when run without it",
)
def hardcoded_rendezvous(m: Module) -> Iterator[Hit]:
    """Overwriting the rendezvous address the launcher set.

    Why: under torchrun the workers connect to the agent's store at ``MASTER_ADDR:MASTER_PORT``; a literal
    ``localhost``/``12355`` written over them breaks multi-node runs (every node looks for the master on
    itself) and collides when two jobs share a host. One finding per function (the address and port are one
    decision). Not reported: ``os.environ.setdefault`` (keeps the launcher's value), writes under a test
    of the launcher's variables (``if "MASTER_ADDR" not in os.environ``, the ``else:`` of
    ``if "RANK" in os.environ``: the fallback for a plain ``python train.py``), non-literal values
    (``str(find_free_port())``), and scripts that start their own processes (``mp.spawn``): they must set
    them.
    Fix: let the launcher set them.
    """
    if not _torchrun_script(m):
        return
    by_scope: dict[ast.AST, list[tuple[ast.AST, str]]] = {}
    for node, key in _rendezvous_writes(m):
        # `if "MASTER_ADDR" not in os.environ:` / the `else:` of `if "RANK" in os.environ:`: a fallback
        guarded = any(
            isinstance(a, ast.If | ast.IfExp) and set(identifiers(a.test)) & _LAUNCHER_VARS
            for a in m.ancestors(node)
        )
        if not guarded:
            by_scope.setdefault(m.scope_of(node), []).append((node, key))
    for writes in by_scope.values():  # MASTER_ADDR and MASTER_PORT together: one decision, one finding
        keys = " and ".join(sorted({key for _, key in writes}))
        verb = (
            "are set to literals in a torchrun script: they override"
            if " and " in keys
            else ("is set to a literal in a torchrun script: it overrides")
        )
        yield Hit(
            writes[0][0],
            f"{keys} {verb} the address torchrun set, so multi-node rendezvous (and two jobs on one host) break",
        )
