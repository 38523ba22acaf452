"""What the rules ask of a parsed file: names resolved through imports, scopes, rank guards, device moves.

Everything here is static and local to one file: a name is resolved through the file's own imports
(``import torch.distributed as dist`` makes ``dist.all_reduce`` mean ``torch.distributed.all_reduce``), and
"flow" means source order inside one scope (a function body, or the module body). Helpers answer
conservatively: where the file cannot tell (a model that comes in as a function argument), rules that use
them stay silent rather than guess.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from functools import cached_property
from typing import Any

from .astutil import (
    RANK_CALLS,
    RANK_ENV,
    RANK_WORD,
    SCOPES,
    ScopeNode,
    blocks,
    dotted,
    evaluated_outside,
    exits,
    identifiers,
    is_const,
    is_device_move,
    kwarg,
    pos,
    uniform_test,
)


class Module:
    """One parsed file and the questions rules ask about it (answers are cached)."""

    def __init__(self, tree: ast.Module, path: str) -> None:
        self.tree = tree
        self.path = path
        self.parents: dict[ast.AST, ast.AST] = {}
        self._scopes: dict[ast.AST, ScopeNode] = {}
        stack: list[tuple[ast.AST, ScopeNode]] = [(tree, tree)]
        while stack:  # one pass: each node's parent and nearest enclosing scope
            parent, scope = stack.pop()
            outside = evaluated_outside(parent)
            for child in ast.iter_child_nodes(parent):
                self.parents[child] = parent
                # a def's decorators, defaults and bases run in the enclosing scope, its body in its own
                own = self._scopes.get(parent, tree) if child in outside else scope
                self._scopes[child] = own
                stack.append((child, child if isinstance(child, SCOPES) else own))
        self.nodes: list[ast.AST] = sorted(ast.walk(tree), key=pos)
        self.calls: list[ast.Call] = [n for n in self.nodes if isinstance(n, ast.Call)]
        self.aliases = self._imports()
        self._by_scope: dict[ast.AST, list[ast.AST]] | None = None
        self._by_last: dict[str, list[ast.Call]] | None = None
        self._callees: dict[ast.Call, str] = {}
        self.memo: dict[str, Any] = {}  # per-file results a rule computes once (e.g. the seeding calls)

    # -- names -------------------------------------------------------------------------------------------

    def _imports(self) -> dict[str, str]:
        # One map for the whole file (imports inside functions included): local name -> full dotted name.
        aliases: dict[str, str] = {}
        for n in self.nodes:
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        head = a.name.split(".", 1)[0]
                        aliases[head] = head
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                for a in n.names:
                    if a.name != "*":
                        aliases[a.asname or a.name] = f"{n.module}.{a.name}"
        # a class or function defined at module level shadows an imported name (class DataLoader: ...)
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        for stmt in self.tree.body:
            if isinstance(stmt, defs):
                aliases.pop(stmt.name, None)
        return aliases

    def qualname(self, expr: ast.AST | None) -> str:
        """The dotted name with its head resolved through imports, ``""`` when not a dotted name."""
        name = dotted(expr)
        if name is None:
            return ""
        head, _, rest = name.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def callee(self, call: ast.Call) -> str:
        """The resolved dotted name of what ``call`` calls (cached; ``""`` for ``f()()`` and the like)."""
        name = self._callees.get(call)
        if name is None:
            name = self._callees[call] = self.qualname(call.func)
        return name

    def is_torch(self, call: ast.Call, *names: str) -> bool:
        """``call`` calls ``torch...<name>`` (or an unresolved ``nn.<name>`` / bare ``<name>``)."""
        full = self.callee(call)
        head, _, last = full.rpartition(".")
        if last not in names or (not head and last in self.local_names):
            return False  # a DataLoader class of the file's own is not torch's
        return head in ("", "torch", "nn") or head.startswith(("torch.", "nn."))

    def is_dist(self, call: ast.Call, *ops: str) -> str | None:
        """The op name when ``call`` is ``torch.distributed.<op>`` (any submodule) for one of ``ops``."""
        full = self.callee(call)
        head, _, last = full.rpartition(".")
        if last in ops and (
            head == "dist" or head == "torch.distributed" or head.startswith("torch.distributed.")
        ):
            return last
        return None

    def calls_to(self, *names: str) -> list[ast.Call]:
        """Calls whose callee's last component is one of ``names`` (any receiver), in source order."""
        if self._by_last is None:
            self._by_last = {}
            for c in self.calls:
                self._by_last.setdefault(self.callee(c).rpartition(".")[2], []).append(c)
        found = [c for name in names for c in self._by_last.get(name, [])]
        return sorted(found, key=pos) if len(names) > 1 else found

    # -- scopes ------------------------------------------------------------------------------------------

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def scope_of(self, node: ast.AST) -> ScopeNode:
        """The nearest enclosing function, lambda, class or the module."""
        return self._scopes.get(node, self.tree)

    def scope_nodes(self, scope: ast.AST) -> list[ast.AST]:
        """The nodes whose nearest scope is ``scope``, in source order (nested defs excluded)."""
        if self._by_scope is None:
            self._by_scope = {}
            for n in self.nodes:
                if n is not self.tree:
                    self._by_scope.setdefault(self.scope_of(n), []).append(n)
        return self._by_scope.get(scope, [])

    @cached_property
    def functions(self) -> dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]]:
        out: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for n in self.nodes:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                out.setdefault(n.name, []).append(n)
        return out

    @cached_property
    def local_names(self) -> frozenset[str]:
        """Names of the classes and functions this file defines."""
        defs = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        return frozenset(n.name for n in self.nodes if isinstance(n, defs))

    @cached_property
    def function_calls(self) -> dict[str, list[ast.Call]]:
        """The calls inside each function of this file (all definitions of a name together)."""
        return {
            name: [c for d in defs for c in ast.walk(d) if isinstance(c, ast.Call)]
            for name, defs in self.functions.items()
        }

    def call_sites(self, func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.Call]:
        """Calls of a function defined in this file: ``f(...)``, or ``self.f(...)`` for a method."""
        out = []
        for c in self.calls_to(func.name):
            f = c.func
            named = (isinstance(f, ast.Name) and f.id == func.name) or (
                isinstance(f, ast.Attribute)
                and f.attr == func.name
                and isinstance(f.value, ast.Name)
                and f.value.id in ("self", "cls")
            )
            if named and func not in self.ancestors(c):
                out.append(c)
        return out

    def enclosing_function(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for a in self.ancestors(node):
            if isinstance(a, ast.FunctionDef | ast.AsyncFunctionDef):
                return a
        return None

    def enclosing_loops(self, node: ast.AST) -> list[ast.For | ast.AsyncFor | ast.While]:
        """The loops around ``node`` inside its scope, innermost first (not counting a loop's own iter)."""
        out = []
        child = node
        for a in self.ancestors(node):
            if isinstance(a, SCOPES):
                break
            if isinstance(a, ast.For | ast.AsyncFor | ast.While) and child not in (
                getattr(a, "iter", None),
                getattr(a, "test", None),
                getattr(a, "target", None),
            ):
                out.append(a)
            child = a
        return out

    # -- ranks -------------------------------------------------------------------------------------------

    def is_rank_test(self, test: ast.AST) -> bool:
        """The condition differs between ranks: it mentions a rank, except ``local_rank == -1`` and the like

        (``-1`` is the old "not distributed" marker, the same on every rank).
        """
        if uniform_test(test):
            return False
        return any(RANK_WORD.search(word) or word in self.rank_aliases for word in identifiers(test))

    @cached_property
    def rank_aliases(self) -> frozenset[str]:
        """Names bound to a rank under another name: ``self.gpu_id = int(os.environ["LOCAL_RANK"])``."""
        out: set[str] = set()
        for n in self.nodes:
            if (
                isinstance(n, ast.Assign | ast.AnnAssign)
                and n.value is not None
                and self._rank_valued(n.value)
            ):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                out |= {d.rpartition(".")[2] for t in targets if (d := dotted(t))}
        return frozenset(out)

    def _rank_valued(self, e: ast.AST) -> bool:
        while isinstance(e, ast.Call) and dotted(e.func) in ("int", "str") and e.args:
            e = e.args[0]
        if isinstance(e, ast.Compare):
            return not uniform_test(e) and self._rank_valued(e.left)  # is_first = local_rank == 0
        if isinstance(e, ast.Subscript):
            return isinstance(e.slice, ast.Constant) and e.slice.value in ("RANK", "LOCAL_RANK", "GROUP_RANK")
        if isinstance(e, ast.Call):
            last = self.callee(e).rpartition(".")[2]
            if last in ("get", "getenv") and e.args and isinstance(e.args[0], ast.Constant):
                return e.args[0].value in ("RANK", "LOCAL_RANK", "GROUP_RANK")
            return last in RANK_CALLS
        name = dotted(e)
        return name is not None and bool(RANK_WORD.search(name.rpartition(".")[2]))

    def rank_condition(self, node: ast.AST) -> ast.If | ast.IfExp | ast.While | None:
        """The nearest ``if`` (in the same scope) with a rank test that has ``node`` in a branch."""
        child = node
        for a in self.ancestors(node):
            if isinstance(a, SCOPES):
                return None
            if (
                isinstance(a, ast.If | ast.IfExp | ast.While)
                and child is not a.test
                and self.is_rank_test(a.test)
            ):
                return a
            child = a
        return None

    def early_exit(self, node: ast.AST) -> ast.If | None:
        """An earlier ``if <rank test>: return/continue/...`` in a block around ``node``: some ranks leave.

        Each block's first such exit and each statement's index are computed once, so asking this for every
        node of a file costs time linear in its size.
        """
        child = node
        for a in self.ancestors(node):
            for block in blocks(a):
                index = self._block_index(block).get(child)
                if index is not None:
                    first = self._first_exit(block)
                    if first is not None and first[0] < index:
                        return first[1]
            if isinstance(a, SCOPES):
                return None
            child = a
        return None

    def _block_index(self, block: list[ast.stmt]) -> dict[ast.AST, int]:
        key = f"index:{id(block)}"
        if key not in self.memo:
            self.memo[key] = {stmt: i for i, stmt in enumerate(block)}
        index: dict[ast.AST, int] = self.memo[key]
        return index

    def _first_exit(self, block: list[ast.stmt]) -> tuple[int, ast.If] | None:
        key = f"exit:{id(block)}"
        if key not in self.memo:
            self.memo[key] = next(
                (
                    (i, stmt)
                    for i, stmt in enumerate(block)
                    if isinstance(stmt, ast.If)
                    and not stmt.orelse
                    and exits(stmt.body)
                    and self.is_rank_test(stmt.test)
                ),
                None,
            )
        found: tuple[int, ast.If] | None = self.memo[key]
        return found

    def rank_guarded(self, node: ast.AST, depth: int = 0) -> bool:
        """Only some ranks reach ``node``: a rank ``if``, an early exit, a rank-zero decorator, or a local

        function whose every call site in this file is itself rank-guarded.
        """
        if self.rank_condition(node) is not None or self.early_exit(node) is not None:
            return True
        func = self.enclosing_function(node)
        if func is None or depth > 3:
            return False
        if any(RANK_WORD.search(w) for d in func.decorator_list for w in identifiers(d)):
            return True
        sites = self.call_sites(func)
        return bool(sites) and all(self.rank_guarded(s, depth + 1) for s in sites)

    # -- what kind of script this is -----------------------------------------------------------------------

    @cached_property
    def reads_rank_env(self) -> bool:
        """``os.environ["LOCAL_RANK"]``, ``os.getenv("RANK")``...: the script expects torchrun's variables."""
        for n in self.nodes:
            if isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
                if n.slice.value in RANK_ENV and "environ" in (dotted(n.value) or ""):
                    return True
            elif (
                isinstance(n, ast.Call)
                and n.args
                and isinstance(n.args[0], ast.Constant)
                and n.args[0].value in RANK_ENV
                and self.callee(n).rpartition(".")[2] in ("get", "getenv")
            ):
                return True
        return False

    @cached_property
    def init_calls(self) -> list[ast.Call]:
        """``init_process_group`` calls (any import spelling), except the single-process "fake" backend."""
        out = []
        for c in self.calls_to("init_process_group"):
            backend = c.args[0] if c.args else kwarg(c, "backend")
            if not is_const(backend, "fake"):
                out.append(c)
        return out

    @cached_property
    def is_distributed(self) -> bool:
        """The script runs as one of several ranks: it starts a process group or reads torchrun's env."""
        if self.init_calls or self.calls_to("init_device_mesh"):
            return True
        if self.calls_to("init_process_group"):
            return False  # only the "fake" backend: one process standing in for many
        if self.reads_rank_env:
            return True
        # a framework that starts (or joins) the process group itself: Fabric, Accelerate, DeepSpeed
        return any(
            self.callee(c) in ("paratrain.init", "paratrain.runtime.init")
            or (
                self.callee(c).startswith("deepspeed.")
                and self.callee(c).endswith(("initialize", "init_distributed"))
            )
            or (
                self.callee(c).rpartition(".")[2] in ("Fabric", "Accelerator")
                and self.callee(c).split(".", 1)[0] in ("lightning", "lightning_fabric", "accelerate", "L")
            )
            for c in self.calls
        )

    def uses_devices(self, scope: ast.AST) -> bool:
        """Code in ``scope`` (or at module level) places things on an accelerator: ``.to(device)``,
        ``.cuda()``, ``device_ids=``, ``set_device``, a non-CPU ``torch.device(...)``, the nccl backend.

        Local on purpose: in a file with CPU and GPU functions, a CPU function is judged on its own code.
        """
        key = f"uses_devices:{id(scope)}"
        if key not in self.memo:
            nodes = self.scope_nodes(scope) + (self.scope_nodes(self.tree) if scope is not self.tree else [])
            self.memo[key] = any(self._places(n) for n in nodes)
        found: bool = self.memo[key]
        return found

    def _places(self, n: ast.AST) -> bool:
        if isinstance(n, ast.Constant):
            return n.value == "nccl" and not isinstance(self.parents.get(n), ast.Compare)
        if not isinstance(n, ast.Call):
            return False
        if is_device_move(n) or kwarg(n, "device_ids") is not None:
            return True
        callee = self.callee(n)
        if callee.endswith("cuda.set_device"):
            return True
        if callee == "torch.device":
            words = [w for a in n.args for w in identifiers(a)]
            return not words or any(w != "cpu" for w in words)
        return False

    @cached_property
    def spawns(self) -> bool:
        """Processes are started by the script itself (mp.spawn, multiprocessing), not by torchrun."""
        return bool(self.calls_to("spawn", "start_processes", "Process", "elastic_launch", "launch_agent"))

    def wrapper_calls(self) -> list[tuple[ast.Call, str]]:
        """Every DDP / FSDP / fully_shard call with its kind: ``"ddp"``, ``"fsdp"`` or ``"fully_shard"``."""
        if "wrappers" not in self.memo:
            found: list[tuple[ast.Call, str]] = []
            for c in self.calls_to("DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP"):
                if self.is_torch(c, "DistributedDataParallel") or self.callee(c) == "DDP":
                    found.append((c, "ddp"))
                elif self.is_torch(c, "FullyShardedDataParallel") or self.callee(c) == "FSDP":
                    found.append((c, "fsdp"))
            found += [
                (c, "fully_shard") for c in self.calls_to("fully_shard") if self.is_torch(c, "fully_shard")
            ]
            self.memo["wrappers"] = sorted(found, key=lambda w: pos(w[0]))
        wrappers: list[tuple[ast.Call, str]] = self.memo["wrappers"]
        return wrappers

    def assigned_before(self, name: str, node: ast.AST) -> list[ast.Assign | ast.AnnAssign]:
        """Assignments to ``name`` in ``node``'s scope that come before the statement holding ``node``."""
        return [
            a
            for a in self.assignments(name, self.scope_of(node))
            if pos(a) < pos(node) and not any(n is node for n in ast.walk(a))
        ]

    def assignments(self, name: str, scope: ast.AST) -> list[ast.Assign | ast.AnnAssign]:
        """Assignments to ``name`` (plain, annotated, or as part of a tuple) in ``scope``, in source order."""
        out: list[ast.Assign | ast.AnnAssign] = []
        for n in self.scope_nodes(scope):
            if isinstance(n, ast.Assign):
                targets: Iterable[ast.AST] = n.targets
            elif isinstance(n, ast.AnnAssign) and n.value is not None:
                targets = [n.target]
            else:
                continue
            if any(dotted(t) == name for tt in targets for t in ast.walk(tt)):
                out.append(n)
        return out
