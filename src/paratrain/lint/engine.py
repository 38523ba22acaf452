"""The lint engine: the rule registry, findings, ignore comments, and running rules over files.

A rule is one function ``check(m: Module) -> Iterable[Hit]`` registered with :func:`rule`; it reads the
parsed module through the helpers of :mod:`paratrain.lint.analysis` and yields a :class:`Hit` per
problem. The engine turns hits into :class:`Finding` s (path, 1-based line and column as ruff prints
them), drops the ones silenced by ``# paratrain: ignore[rule-id]`` (or a bare ``# paratrain: ignore``) on
their line, and sorts them. A file that does not parse yields one ``syntax-error`` finding instead.

Only the standard library is used here (``ast``, ``tokenize``): linting never imports torch.
"""

from __future__ import annotations

import ast
import io
import re
import stat
import tokenize
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.errors import ConfigError, suggest

from .analysis import Module
from .registry import RULES, Rule, Severity

# Group names accepted wherever rule ids are (``--select``, ``--extend-select``, ``--ignore``, pyproject).
GROUPS: tuple[str, ...] = ("default", "hygiene", "ALL")

SYNTAX_ERROR = "syntax-error"
SYNTAX_ERROR_CODE = "PTL000"

# Directory names never descended into when a directory is linted (explicitly named files always are).
_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages", "venv"})


@dataclass(frozen=True)
class Finding:
    """One problem in one file. ``line`` and ``col`` are 1-based, as ruff and flake8 print them."""

    path: str
    line: int
    col: int
    rule: str
    severity: Severity
    message: str
    fix: str

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "rule": self.rule,
            "severity": self.severity,
            "message": self.message,
            "fix": self.fix,
        }


@dataclass
class LintReport:
    """The result of :func:`lint_paths`: how many files were read and every finding, sorted."""

    files: int = 0
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        """The ``--json`` contract: ``{"files": N, "findings": [{path, line, col, rule, ...}]}``."""
        return {"files": self.files, "findings": [f.to_dict() for f in self.findings]}


def load_rules() -> dict[str, Rule]:
    """:data:`RULES`, filled: importing the theme modules runs their ``@rule`` decorators (code order)."""
    from . import rules_device, rules_loop, rules_model, rules_process, rules_ranks  # noqa: F401

    if list(RULES) != sorted(RULES, key=lambda r: RULES[r].code):
        ordered = sorted(RULES.values(), key=lambda r: r.code)
        RULES.clear()
        RULES.update((r.id, r) for r in ordered)
    return RULES


def resolve_rule_ids(names: Iterable[str]) -> set[str]:
    """Rule ids for user-given ids, flake8 codes or groups (``unsafe-torch-load``, ``PTL012``, ``hygiene``,
    ``default``, ``ALL``); ConfigError for anything else."""
    rules = load_rules()
    by_code = {r.code: r.id for r in rules.values()} | {SYNTAX_ERROR_CODE: SYNTAX_ERROR}
    known = [*rules, SYNTAX_ERROR]
    out: set[str] = set()
    for raw in names:
        name = raw.strip()
        if not name:
            continue
        if name.upper() in ("ALL", "PTL"):
            out |= set(known)
        elif name.lower() in ("default", "hygiene"):
            out |= {r.id for r in rules.values() if r.tier == name.lower()}
        elif name in known:
            out.add(name)
        elif name.upper() in by_code:
            out.add(by_code[name.upper()])
        else:
            raise ConfigError(f"unknown lint rule {name!r}. {suggest(name, [*known, *GROUPS])}")
    return out


def default_rule_ids() -> set[str]:
    """What runs when nothing is selected: the default tier, and ``syntax-error``."""
    return {r.id for r in load_rules().values() if r.tier == "default"} | {SYNTAX_ERROR}


_IGNORE = re.compile(r"#\s*paratrain:\s*ignore\b(?:\[([^\]]*)\])?", re.IGNORECASE)
ALL = "*"


def ignore_comments(text: str) -> dict[int, set[str]]:
    """``{line: rule ids}`` silenced by ``# paratrain: ignore[a, b]`` comments; ``{"*"}`` for a bare one."""
    out: dict[int, set[str]] = {}
    if "paratrain" not in text.lower():
        return out  # nothing to find: skip tokenizing

    def add(line: int, comment: str) -> None:
        for match in _IGNORE.finditer(comment):
            ids = match.group(1)
            names = {ALL} if ids is None else {s.strip() for s in ids.split(",") if s.strip()}
            out.setdefault(line, set()).update(names or {ALL})

    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                add(tok.start[0], tok.string)
    except (tokenize.TokenError, SyntaxError):
        # Only reached for source that ast parsed but tokenize did not: scan the lines instead.
        for number, line in enumerate(text.splitlines(), start=1):
            if "#" in line:
                add(number, line[line.index("#") :])
    return out


def _chosen(
    select: Iterable[str] | None, ignore: Iterable[str] | None, extend_select: Iterable[str] | None = None
) -> set[str]:
    """ruff's semantics: ``select`` replaces the default set, ``extend_select`` adds to it, ``ignore`` wins."""
    chosen = resolve_rule_ids(select) if select is not None else default_rule_ids()
    chosen |= resolve_rule_ids(extend_select) if extend_select is not None else set()
    return chosen - (resolve_rule_ids(ignore) if ignore is not None else set())


def _position(node: ast.AST) -> tuple[int, int]:
    return getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1


def lint_tree(
    tree: ast.Module,
    text: str,
    path: str,
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    extend_select: Iterable[str] | None = None,
) -> list[Finding]:
    """Run the rules over an already parsed module (the flake8 plugin passes flake8's tree).

    ``select``/``extend_select``/``ignore`` take rule ids, flake8 codes or groups (``hygiene``...); an
    unknown one raises :class:`ConfigError`. Without ``select``, the default tier runs.
    """
    rules = load_rules()
    chosen = _chosen(select, ignore, extend_select)
    module = Module(tree, path)
    silenced = ignore_comments(text)
    findings: set[Finding] = set()
    for r in rules.values():
        if r.id not in chosen:
            continue
        for hit in r.check(module):
            line, col = _position(hit.node)
            muted = silenced.get(line, set())
            if ALL in muted or r.id in muted:
                continue
            severity = hit.severity or r.severity
            findings.add(Finding(path, line, col, r.id, severity, hit.message, hit.fix or r.fix))
    return sorted(findings, key=lambda f: (f.line, f.col, f.rule))


def lint_source(
    text: str,
    path: str = "<string>",
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    extend_select: Iterable[str] | None = None,
) -> list[Finding]:
    """Findings for one file's source ``text``; a file that does not parse gives one ``syntax-error``.

    ``select``/``extend_select``/``ignore`` as :func:`lint_tree` takes them.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in the user's strings are not ours
            tree = ast.parse(text, filename=path)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        # ValueError: source with NUL bytes; RecursionError/MemoryError: nesting deeper than the parser takes
        # Reported even when --select leaves it out (as ruff does): a file that does not parse went unchecked.
        if SYNTAX_ERROR not in _chosen(None, ignore):
            return []
        line = getattr(e, "lineno", None) or 1
        col = getattr(e, "offset", None) or 1
        reason = getattr(e, "msg", None) or str(e) or type(e).__name__
        return [
            Finding(
                path,
                line,
                col,
                SYNTAX_ERROR,
                "error",
                f"the file does not parse as Python 3.11+: {reason}; no other rule ran on it",
                "fix the syntax (python -m py_compile FILE shows the same error)",
            )
        ]
    return lint_tree(tree, text, path, select, ignore, extend_select)


def read_source(path: Path) -> str:
    """The text of a Python file, decoded as Python does (PEP 263 coding line, UTF-8 by default)."""
    data = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    return data.decode(encoding)


def iter_python_files(paths: Sequence[str | Path]) -> Iterator[Path]:
    """Each named file, and every ``*.py`` under each named directory (sorted; hidden dirs skipped).

    A named path that is neither a regular file nor a directory (a FIFO, ``/dev/zero``) raises
    :class:`ConfigError` before anything is read; in a directory, such entries are skipped.
    """
    missing = [str(p) for p in paths if not Path(p).exists()]
    if missing:
        raise ConfigError(f"no such file or directory: {', '.join(missing)}")
    for p in paths:  # a FIFO or a device would block or never end: refuse before reading anything
        mode = Path(p).stat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            kind = (
                "a FIFO"
                if stat.S_ISFIFO(mode)
                else "a device"
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else ("a socket" if stat.S_ISSOCK(mode) else "not a regular file")
            )
            raise ConfigError(
                f"{p} is {kind}, not a Python source file: name .py files or directories to lint"
            )
    seen: set[Path] = set()
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(
                f
                for f in p.rglob("*.py")
                if f.is_file()
                and not any(
                    part.startswith(".") or part in _SKIP_DIRS for part in f.relative_to(p).parts[:-1]
                )
            )
        else:
            files = [p]
        for f in files:
            if f not in seen:
                seen.add(f)
                yield f


def lint_paths(
    paths: Sequence[str | Path],
    select: Iterable[str] | None = None,
    ignore: Iterable[str] | None = None,
    extend_select: Iterable[str] | None = None,
) -> LintReport:
    """Lint files and directories (``*.py`` recursively). A missing path raises :class:`ConfigError`.

    ``select``/``extend_select``/``ignore`` as :func:`lint_tree` takes them.
    """
    chosen = sorted(_chosen(select, None, extend_select))
    dropped = resolve_rule_ids(ignore) if ignore is not None else None
    report = LintReport()
    for f in iter_python_files(paths):
        report.files += 1
        try:
            text = read_source(f)
        except (OSError, UnicodeDecodeError, SyntaxError, LookupError) as e:  # LookupError: `# coding: rot13`
            message = f"cannot read the file as Python source: {e}"
            fix = "save the file as UTF-8 (or declare its encoding in a coding comment)"
            report.findings.append(Finding(str(f), 1, 1, SYNTAX_ERROR, "error", message, fix))
            continue
        report.findings.extend(lint_source(text, str(f), chosen, dropped))
    return report
