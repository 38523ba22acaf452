"""paratrain's rules as a flake8 plugin, under the ``PTL`` prefix (the TorchFix convention).

Register it in pyproject.toml::

    [project.entry-points."flake8.extension"]
    PTL = "paratrain.lint.flake8:ParatrainChecker"

then ``flake8 --select PTL train.py``. Codes are stable, one per rule id (``paratrain lint --list-rules``):

    PTL001 data-parallel                PTL009 accumulation-without-no-sync
    PTL002 ddp-before-device            PTL010 find-unused-parameters
    PTL003 no-distributed-sampler       PTL011 rank-conditional-collective
    PTL004 no-set-epoch                 PTL012 unsafe-torch-load
    PTL005 batchnorm-not-synced         PTL013 save-on-every-rank
    PTL006 loss-not-on-device           PTL014 no-destroy-process-group
    PTL007 hardcoded-device             PTL015 hardcoded-rendezvous
    PTL008 unseeded-init                PTL016 unreduced-metric
    PTL017 unseeded-split               PTL020 context-manager-not-entered
    PTL018 global-rank-as-device        PTL021 local-rank-as-rank
    PTL019 rank-independent-seed

The plugin runs the rules ``paratrain lint`` would: the default tier, or what ``[tool.paratrain.lint]`` in
the nearest ``pyproject.toml`` selects (``extend-select = ["hygiene"]`` for the opt-in rules).
(``syntax-error`` is PTL000 in ``--select``; flake8 reports unparsable files itself, as E999.) Each
message ends with the rule id in brackets; ``paratrain lint`` prints the fix as well. flake8 applies its
own ``# noqa: PTL003``; ``# paratrain: ignore[...]`` comments are honored as well.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Sequence
from pathlib import Path

from paratrain import __version__

from .engine import RULES, lint_tree, load_rules, read_source
from .settings import find_settings


class ParatrainChecker:
    """flake8 AST plugin: flake8 passes ``tree``, ``filename`` and ``lines``; ``run()`` yields findings."""

    name = "paratrain-lint"
    version = __version__

    def __init__(self, tree: ast.AST, filename: str = "<string>", lines: Sequence[str] | None = None) -> None:
        self.tree = tree
        self.filename = filename
        self.lines = lines

    def _text(self) -> str:
        if self.lines is not None:
            return "".join(self.lines)
        try:
            return read_source(Path(self.filename))
        except (OSError, UnicodeDecodeError, SyntaxError):
            return ""  # no ignore comments can be read: every finding is reported

    def run(self) -> Iterator[tuple[int, int, str, type]]:
        """``(line, col, "PTL### message", type)`` per finding; col is 0-based, as flake8 expects."""
        if not isinstance(self.tree, ast.Module):
            return
        rules = load_rules()
        settings = find_settings(Path.cwd())  # flake8 runs from the project root, as ruff looks it up
        chosen = (settings.select, settings.ignore, settings.extend_select)
        for f in lint_tree(self.tree, self._text(), self.filename, *chosen):
            code = rules[f.rule].code
            yield f.line, f.col - 1, f"{code} {f.message} [{f.rule}]", type(self)


__all__ = ["RULES", "ParatrainChecker"]
