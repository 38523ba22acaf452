"""Aligned plain-text tables: the one helper every command's text output uses (torch-free, no imports).

Cells are strings, formatted by the caller (units and precision are the caller's business); a column is as
wide as its widest cell, or its ``width`` when that is more, so fixed-width layouts stay fixed. Trailing
blanks are dropped. ``--json`` output never goes through here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Col:
    """One column: its title, alignment (``<`` left, ``>`` right), least width and the blanks before it."""

    title: str = ""
    align: str = "<"
    width: int = 0
    gap: int | None = None
    """Blanks between this column and the previous one (default: the table's ``sep``)."""


def table(
    cols: Sequence[Col], rows: Iterable[Sequence[str]], *, header: bool = True, sep: int = 1
) -> list[str]:
    """The header line (unless ``header=False``) and one line per row. A row may have fewer cells than
    there are columns (the line stops after its last cell: a caller appends a note to it)."""
    body = [list(r) for r in rows]
    lines = [[c.title for c in cols]] if header else []
    lines += body
    widths = [max([c.width, *(len(r[i]) for r in lines if i < len(r))]) for i, c in enumerate(cols)]
    out = []
    for r in lines:
        parts = []
        for i, cell in enumerate(r):
            c = cols[i]
            if i:
                parts.append(" " * (sep if c.gap is None else c.gap))
            parts.append(cell.rjust(widths[i]) if c.align == ">" else cell.ljust(widths[i]))
        out.append("".join(parts).rstrip())
    return out


def key_values(rows: Sequence[tuple[str, str]], *, align: str = "<", sep: int = 1) -> list[str]:
    """``key value`` lines with the keys in one column (``align`` ``>``: keys right-aligned)."""
    return table([Col(align=align), Col()], rows, header=False, sep=sep)
