"""What a value is, as far as one file shows: the values a name was assigned, whether an expression
differs between ranks, and whether it is the global or the node-local rank."""

from __future__ import annotations

import ast
import re

from .analysis import Module
from .astutil import RANK_CALLS, RANK_WORD, dotted, pos


def bound_values(m: Module, name: str, before: ast.AST) -> list[ast.expr]:
    """The values assigned to ``name`` that can reach ``before``: earlier in its scope (or at module
    level), ``m.x = ...`` anywhere in the file for an attribute, ``x += ...`` included."""
    out: list[ast.expr] = []
    functions = [f for fs in m.functions.values() for f in fs]
    scopes: list[ast.AST] = [m.scope_of(before)] if "." not in name else [m.tree, *functions]
    if m.tree not in scopes:
        scopes.append(m.tree)
    for scope in scopes:
        for n in m.scope_nodes(scope):
            if "." not in name and scope is not m.tree and pos(n) >= pos(before):
                continue
            if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None:
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(dotted(t) == name for tt in targets for t in ast.walk(tt)):
                    out.append(n.value)
            elif isinstance(n, ast.AugAssign) and dotted(n.target) == name:
                out.append(n.value)
    return out


def sources(m: Module, expr: ast.AST, before: ast.AST, depth: int = 3) -> list[ast.AST]:
    """``expr`` and, through the names in it, the values they were assigned (``depth`` levels deep)."""
    out: list[ast.AST] = [expr]
    todo: list[ast.AST] = [expr]
    seen: set[str] = set()
    for _ in range(depth):
        nxt: list[ast.AST] = []
        for e in todo:
            for n in ast.walk(e):
                name = dotted(n) if isinstance(n, ast.Name | ast.Attribute) else None
                if name is None or name in seen:
                    continue
                seen.add(name)
                nxt += bound_values(m, name, before)
        out += nxt
        todo = nxt
    return out


def rank_dependent(m: Module, expr: ast.AST, before: ast.AST) -> bool:
    """``expr`` differs between ranks: it mentions a rank, directly or through the names it is built from
    (``seed = base + rank`` ... ``manual_seed(seed)``)."""
    for e in sources(m, expr, before):
        for n in ast.walk(e):
            if isinstance(n, ast.Constant) and n.value in ("RANK", "LOCAL_RANK", "GROUP_RANK"):
                return True
            if isinstance(n, ast.Call) and m.callee(n).rpartition(".")[2] in RANK_CALLS:
                return True
            word = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
            if word is not None and (RANK_WORD.search(word) or word in m.rank_aliases):
                return True
    return False


def rank_kind(m: Module, expr: ast.AST, before: ast.AST) -> str | None:
    """``"global"`` when ``expr`` is the global rank (``dist.get_rank()``, ``int(os.environ["RANK"])``, or
    a name bound to one), ``"local"`` for the node-local rank (``LOCAL_RANK``, ``get_local_rank()``, a
    name spelled ``local_rank``), None when the file cannot tell."""
    name = dotted(expr)
    values = bound_values(m, name, before) if name is not None else []
    for depth, e in enumerate([expr, *values]):
        while isinstance(e, ast.Call) and dotted(e.func) in ("int", "str") and e.args:
            e = e.args[0]
        if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Constant):
            key = e.slice.value
        elif isinstance(e, ast.Call) and e.args and isinstance(e.args[0], ast.Constant):
            key = e.args[0].value if m.callee(e).rpartition(".")[2] in ("get", "getenv") else None
        else:
            key = None
        if key == "RANK":
            return "global"
        if key == "LOCAL_RANK":
            return "local"
        if isinstance(e, ast.Call):
            last = m.callee(e).rpartition(".")[2]
            if last in ("get_rank", "get_global_rank") and not e.args:
                return "global"
            if last in ("get_local_rank", "get_node_local_rank"):
                return "local"
        name = (dotted(e) or "").rpartition(".")[2]
        if depth == 0 and re.fullmatch(r"(?:local_rank|ddp_local_rank|local_gpu_id)", name):
            return "local"
    return None
