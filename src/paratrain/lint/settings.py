"""``[tool.paratrain.lint]`` in ``pyproject.toml``: which rules run, as ruff's ``select``/``extend-select``/``ignore``.

    [tool.paratrain.lint]
    extend-select = ["hygiene"]          # add the opt-in rules (unsafe-torch-load, no-destroy-process-group)
    ignore = ["find-unused-parameters"]  # rule ids, PTL codes, or the groups default / hygiene / ALL

The nearest ``pyproject.toml`` at or above the starting directory that has the table is used (as ruff looks
for its own). Flags on the command line win: ``--select`` replaces the file's ``select``, ``--extend-select``
and ``--ignore`` add to the file's lists.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from paratrain.errors import ConfigError

from .engine import resolve_rule_ids

_KEYS = ("select", "extend-select", "ignore")


@dataclass(frozen=True)
class LintSettings:
    """Rule selection read from one ``[tool.paratrain.lint]`` table (``source`` is that file, or None)."""

    select: list[str] | None = None
    extend_select: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    source: Path | None = None


def _names(value: object, key: str, path: Path) -> list[str]:
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ConfigError(
            f'{path}: [tool.paratrain.lint] {key} must be a list of rule ids, e.g. {key} = ["hygiene"]'
        )
    return list(value)


def find_settings(start: Path) -> LintSettings:
    """The settings of the nearest ``pyproject.toml`` with a ``[tool.paratrain.lint]`` table, else the defaults.

    A malformed file, an unknown key or an unknown rule id raises :class:`ConfigError` naming the file.
    """
    start = start.resolve()
    for folder in [start, *start.parents]:
        path = folder / "pyproject.toml"
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{path}: cannot read it as TOML ({e}); fix it or run with --isolated") from e
        table = data.get("tool", {}).get("paratrain", {}).get("lint")
        if table is None:
            continue
        unknown = sorted(set(table) - set(_KEYS))
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)} in [tool.paratrain.lint]; "
                              f"the keys are {', '.join(_KEYS)}")  # fmt: skip
        settings = LintSettings(
            select=_names(table["select"], "select", path) if "select" in table else None,
            extend_select=_names(table.get("extend-select", []), "extend-select", path),
            ignore=_names(table.get("ignore", []), "ignore", path),
            source=path,
        )
        try:
            for names in (settings.select or [], settings.extend_select, settings.ignore):
                resolve_rule_ids(names)
        except ConfigError as e:
            raise ConfigError(f"{path}: [tool.paratrain.lint]: {e}") from e
        return settings
    return LintSettings()


__all__ = ["LintSettings", "find_settings"]
