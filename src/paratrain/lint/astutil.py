"""Pure helpers over ``ast`` nodes, and the vocabulary of torch.distributed the rules recognize.

Names (dotted chains, identifiers, keyword arguments), constants, device moves, block exits, and the tables
of collectives and rank words. Nothing here knows about a whole file: :mod:`.analysis` does.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

ScopeNode = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef
SCOPES = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)

# torch.distributed collectives: every rank of the group must call them, in the same order. Point-to-point
# send/recv/isend/irecv are not in the list: they are rank-specific by design.
# The value is the index of the positional ``group`` argument (a call on a subgroup is legitimately issued
# only by that subgroup's members, so it cannot be judged from a rank condition).
COLLECTIVES: dict[str, int] = {
    "all_reduce": 2,
    "all_reduce_coalesced": 2,
    "all_gather": 2,
    "all_gather_into_tensor": 2,
    "all_gather_coalesced": 2,
    "all_gather_object": 2,
    "_all_gather_base": 2,
    "reduce_scatter": 3,
    "reduce_scatter_tensor": 3,
    "_reduce_scatter_base": 3,
    "broadcast": 2,
    "broadcast_object_list": 2,
    "barrier": 0,
    "monitored_barrier": 0,
    "reduce": 3,
    "gather": 3,
    "gather_object": 3,
    "scatter": 3,
    "scatter_object_list": 3,
    "all_to_all": 2,
    "all_to_all_single": 4,
    # torch.distributed._functional_collectives (funcol): the group is the third or fourth argument
    "all_gather_tensor": 2,
    "all_gather_into_tensor_coalesced": 1,
    "reduce_scatter_tensor_coalesced": 3,
}
# The collectives that combine values across ranks (what unreduced-metric looks for).
REDUCING = frozenset(COLLECTIVES) - {"barrier", "monitored_barrier", "broadcast", "broadcast_object_list"}

# Identifiers that make an ``if`` test depend on the rank: rank, local_rank, get_rank(), RANK, dp_rank,
# is_main, master_process (nanoGPT), is_global_zero (Lightning), is_main_process (Accelerate) ...
RANK_WORD = re.compile(
    r"(?:^|_)rank\d*(?:_|$)|^is_(?:local_|global_)?(?:main|master|chief|leader|primary)(?:_rank|_process)?$"
    r"|^(?:local_|global_)?(?:main|master)_process$|^is_global_zero$|^rank_?zero|^(?:local_)?gpu(?:_id)?$",
    re.IGNORECASE,
)
RANK_ENV = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"})
RANK_CALLS = frozenset(
    {"get_rank", "get_local_rank", "get_node_local_rank", "get_global_rank", "get_group_rank"}
)
_DTYPES = frozenset(
    {"float", "float16", "float32", "float64", "half", "double", "bfloat16", "int", "int8", "int16", "int32"}
    | {"int64", "long", "short", "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"}
)
_MOVE_METHODS = frozenset({"cuda", "xpu", "npu", "mps", "to_empty"})
_EXITS = frozenset({"exit", "_exit", "quit"})


def pos(node: ast.AST) -> tuple[int, int]:
    """(line, column) of a node, for source-order sorting."""
    return getattr(node, "lineno", 0), getattr(node, "col_offset", 0)


def dotted(expr: ast.AST | None) -> str | None:
    """``"a.b.c"`` for a Name/Attribute chain, None for anything else."""
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if isinstance(expr, ast.Name):
        parts.append(expr.id)
        return ".".join(reversed(parts))
    return None


def root_name(expr: ast.AST | None) -> str | None:
    """The variable an expression starts from: ``model`` for ``model.module.fc`` or ``model[0]``."""
    while isinstance(expr, ast.Attribute | ast.Subscript | ast.Call | ast.Starred):
        expr = expr.func if isinstance(expr, ast.Call) else expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def identifiers(expr: ast.AST) -> Iterator[str]:
    """Every Name id, Attribute attr and string constant inside ``expr``."""
    for n in ast.walk(expr):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            yield n.value


def names_in(expr: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}


def kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for k in call.keywords:
        if k.arg == name:
            return k.value
    return None


def is_const(expr: ast.AST | None, value: object) -> bool:
    return isinstance(expr, ast.Constant) and type(expr.value) is type(value) and expr.value == value


def is_dtype(expr: ast.AST) -> bool:
    """``torch.float16``, a variable named ``dtype``...: a ``.to()`` argument that is not a device."""
    name = dotted(expr)
    if name is None:
        return False
    last = name.rsplit(".", 1)[-1]
    return (name.startswith("torch.") and last in _DTYPES) or "dtype" in last.lower()


def is_device_move(call: ast.Call) -> bool:
    """A move to a device: ``x.to(device)``, ``x.cuda()``, ``x.to_empty(device=d)``; not ``x.to(dtype)``."""
    if not isinstance(call.func, ast.Attribute):
        return False
    attr = call.func.attr
    if attr in _MOVE_METHODS:
        return dotted(call.func.value) not in ("torch", "torch.cuda")
    if attr == "to":
        device = kwarg(call, "device")
        if device is not None and not is_const(device, None):
            return True
        return bool(call.args) and not is_dtype(call.args[0]) and not is_const(call.args[0], None)
    return False


def exits(body: list[ast.stmt]) -> bool:
    """The block ends by leaving: return, continue, break, raise, sys.exit()."""
    if not body:
        return False
    last = body[-1]
    if isinstance(last, ast.Return | ast.Continue | ast.Break | ast.Raise):
        return True
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        name = dotted(last.value.func) or ""
        return name.rsplit(".", 1)[-1] in _EXITS
    return False


def uniform_test(test: ast.AST) -> bool:
    """``rank != -1`` / ``local_rank >= 0``: "is this run distributed", the same answer on every rank."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    other, op = test.comparators[0], test.ops[0]
    minus_one = (
        isinstance(other, ast.UnaryOp) and isinstance(other.op, ast.USub) and is_const(other.operand, 1)
    )
    return (minus_one and isinstance(op, ast.Eq | ast.NotEq | ast.Gt)) or (
        is_const(other, 0) and isinstance(op, ast.GtE)
    )


def blocks(node: ast.AST) -> Iterator[list[ast.stmt]]:
    for name in ("body", "orelse", "finalbody"):
        block = getattr(node, name, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield block


def evaluated_outside(node: ast.AST) -> list[ast.AST]:
    """The parts of a def/class/lambda that are evaluated in the enclosing scope (decorators, defaults...)."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return [*node.decorator_list, node.args, *([node.returns] if node.returns else [])]
    if isinstance(node, ast.ClassDef):
        return [*node.decorator_list, *node.bases, *node.keywords]
    if isinstance(node, ast.Lambda):
        return [node.args]
    return []
