"""``paratrain lint``: a static checker for torchrun-style training scripts (the classic DDP pitfalls and more).

    from paratrain.lint import lint_paths, lint_source, RULES
    report = lint_paths(["train.py"])          # LintReport(files=1, findings=[Finding(...), ...])
    lint_source(text, "train.py")              # list[Finding] for one file's text

One function per rule (``rules_device``, ``rules_model``, ``rules_loop``, ``rules_process``), registered in
:data:`RULES` (rule id -> :class:`Rule`, in flake8-code order). Pure source analysis with ``ast``: importing
this package does not import torch. See docs/lint.md.
"""

from __future__ import annotations

from .engine import (
    RULES,
    SYNTAX_ERROR,
    Finding,
    LintReport,
    Rule,
    ignore_comments,
    lint_paths,
    lint_source,
    lint_tree,
    load_rules,
    resolve_rule_ids,
)

load_rules()

__all__ = [
    "RULES",
    "SYNTAX_ERROR",
    "Finding",
    "LintReport",
    "Rule",
    "ignore_comments",
    "lint_paths",
    "lint_source",
    "lint_tree",
    "load_rules",
    "resolve_rule_ids",
]
