"""``paratrain lint [--json] [--select RULES] [--extend-select RULES] [--ignore RULES] [--list-rules] PATH...``.

Rules come in two tiers: ``default`` (their findings are mistakes) and ``hygiene`` (opt-in good practice).
Selection follows ruff: ``--select`` replaces the default set, ``--extend-select`` adds to it, ``--ignore``
removes; each takes rule ids, PTL codes or the groups ``default``, ``hygiene``, ``ALL``. The nearest
``pyproject.toml`` with a ``[tool.paratrain.lint]`` table gives the same keys (``--isolated`` skips it).

Exit codes: 0 when the files are clean, 1 when there is any finding, 2 on a usage error (a missing path,
an unknown rule id, no path given). ``--json`` prints exactly one object on stdout:
``{"files": N, "findings": [{"path", "line", "col", "rule", "severity", "message", "fix"}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from paratrain.errors import ConfigError
from paratrain.tables import Col, table

from .engine import RULES, SYNTAX_ERROR, SYNTAX_ERROR_CODE, LintReport, lint_paths, load_rules
from .settings import LintSettings, find_settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``lint``'s arguments to ``p`` (the ``paratrain lint`` subparser, or a standalone parser)."""
    p.add_argument("paths", nargs="*", metavar="PATH", help="Python files, or directories searched for *.py")
    p.add_argument(
        "--json", action="store_true", help='print one JSON object: {"files": N, "findings": [...]}'
    )
    p.add_argument(
        "--select",
        metavar="RULES",
        help="comma-separated rule ids, PTL codes or groups (default, hygiene, ALL) to run instead of the "
        "default tier",
    )
    p.add_argument(
        "--extend-select", metavar="RULES", help="rules or groups to run in addition (e.g. hygiene)"
    )
    p.add_argument("--ignore", metavar="RULES", help="comma-separated rule ids (or PTL codes) to skip")
    p.add_argument("--isolated", action="store_true", help="ignore [tool.paratrain.lint] in pyproject.toml")
    p.add_argument(
        "--list-rules", action="store_true", help="print every rule (id, code, tier, severity, summary)"
    )


def _split(value: str | None) -> list[str] | None:
    return None if value is None else [s for s in value.split(",") if s.strip()]


def _list_rules(as_json: bool) -> int:
    rules = load_rules()
    rows = [(r.id, r.code, r.tier, r.severity, r.summary) for r in rules.values()]
    rows.append(
        (
            SYNTAX_ERROR,
            SYNTAX_ERROR_CODE,
            "default",
            "error",
            "the file does not parse; no other rule ran on it",
        )
    )
    if as_json:
        keys = ("id", "code", "tier", "severity", "summary")
        print(json.dumps({"rules": [dict(zip(keys, row, strict=True)) for row in rows]}))
        return 0
    cols = [Col(), Col(), Col(width=7), Col(width=7), Col()]
    print("\n".join(table(cols, rows, header=False, sep=2)))
    return 0


def selection(args: argparse.Namespace) -> tuple[list[str] | None, list[str], list[str]]:
    """(select, extend_select, ignore) from the flags over ``[tool.paratrain.lint]`` (unless --isolated)."""
    settings = LintSettings() if getattr(args, "isolated", False) else find_settings(Path.cwd())
    select = _split(getattr(args, "select", None))
    extend = _split(getattr(args, "extend_select", None)) or []
    ignore = _split(getattr(args, "ignore", None)) or []
    return (
        select if select is not None else settings.select,
        [*settings.extend_select, *extend],
        [*settings.ignore, *ignore],
    )


def _print_text(report: LintReport) -> None:
    for f in report.findings:
        print(f"{f.path}:{f.line}:{f.col}: {f.rule}  {f.message}")
        print(f"    fix: {f.fix}")
    files = f"{report.files} file{'s' if report.files != 1 else ''}"
    if not report.findings:
        print(f"All checks passed ({files}).")
        return
    errors = sum(f.severity == "error" for f in report.findings)
    warnings = len(report.findings) - errors
    n = len(report.findings)
    print(
        f"Found {n} finding{'s' if n != 1 else ''} ({errors} error{'s' if errors != 1 else ''}, "
        f"{warnings} warning{'s' if warnings != 1 else ''}) in {files}."
    )


def run(args: argparse.Namespace) -> int:
    """Run ``paratrain lint``: print the findings and return the exit code (0 clean, 1 findings, 2 usage)."""
    as_json = bool(getattr(args, "json", False))
    if getattr(args, "list_rules", False):
        return _list_rules(as_json)
    paths: list[str] = list(getattr(args, "paths", None) or [])
    try:
        if not paths:
            raise ConfigError("no PATH given: name the files or directories to lint (or use --list-rules)")
        select, extend, ignore = selection(args)
        report = lint_paths(paths, select=select, ignore=ignore, extend_select=extend)
    except ConfigError as e:
        print(f"paratrain lint: error: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(report.to_dict()))
    else:
        _print_text(report)
    return 1 if report.findings else 0


def main(argv: list[str] | None = None, prog: str = "paratrain lint") -> int:
    """Parse ``argv`` (``sys.argv[1:]`` when None) as ``paratrain lint``'s arguments and run it.

    This is what ``paratrain lint`` and ``python -m paratrain.lint`` call: it imports only this package and
    the standard library, so linting starts without torch.
    """
    parser = argparse.ArgumentParser(
        prog=prog, description="Static checks for distributed PyTorch training scripts (see docs/lint.md)."
    )
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except BrokenPipeError:  # `... | head`: the reader left; exit quietly as other CLI tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


__all__ = ["RULES", "add_arguments", "main", "run", "selection"]
