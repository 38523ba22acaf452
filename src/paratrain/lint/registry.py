"""The rule registry: what a rule is, what it yields, and the ``@rule`` decorator that registers it.

The theme modules (``rules_*``) import this module and register their rules when imported; the engine
(:mod:`.engine`) imports them to fill :data:`RULES`. Nothing here imports a rule module back.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from .analysis import Module

__all__ = ["RULES", "Check", "Hit", "Rule", "Severity", "Tier", "rule"]

Severity = Literal["error", "warning"]
Tier = Literal["default", "hygiene"]


@dataclass(frozen=True)
class Hit:
    """What a rule function yields: where, what is wrong, and optionally a severity or fix of its own."""

    node: ast.AST
    message: str
    severity: Severity | None = None
    fix: str | None = None


Check = Callable[[Module], Iterable[Hit]]


@dataclass(frozen=True)
class Rule:
    """One registered rule. ``id`` and ``code`` are a contract (CLI, JSON, ignore comments, flake8)."""

    id: str
    code: str
    severity: Severity
    summary: str
    fix: str
    check: Check = field(repr=False, compare=False)
    tier: Tier = "default"


# Filled by the @rule decorator when the rule modules are imported (see load_rules).
RULES: dict[str, Rule] = {}


def rule(
    rule_id: str, code: str, severity: Severity, summary: str, fix: str, tier: Tier = "default"
) -> Callable[[Check], Check]:
    """Register ``check`` as the rule ``rule_id`` (flake8 code ``code``) with its default severity and fix.

    ``tier="default"`` rules run unless deselected: their findings are mistakes. ``tier="hygiene"`` rules
    (good practice whose absence is rarely a bug) run only when selected by id or with the ``hygiene`` group.
    """

    def register(check: Check) -> Check:
        if rule_id in RULES or any(r.code == code for r in RULES.values()):
            raise RuntimeError(f"lint rule {rule_id} ({code}) registered twice")
        RULES[rule_id] = Rule(rule_id, code, severity, summary, fix, check, tier)
        return check

    return register
