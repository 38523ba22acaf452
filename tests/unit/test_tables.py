"""The one text-table helper: column widths, alignment, gaps, short rows."""

from __future__ import annotations

from paratrain.tables import Col, key_values, table


def test_columns_take_the_widest_cell_or_their_least_width() -> None:
    cols = [Col("rank", ">", 6), Col("name"), Col("ms", ">")]
    lines = table(cols, [["0", "ring", "1.50"], ["12", "hierarchical", "10.25"]])
    assert lines == [
        "  rank name            ms",
        "     0 ring          1.50",
        "    12 hierarchical 10.25",
    ]


def test_a_gap_short_rows_and_no_trailing_blanks() -> None:
    cols = [Col("a", ">", 3), Col("b", width=5, gap=3), Col("c")]
    lines = table(cols, [["1", "x", "y"], ["2", "z"], ["3", "", ""]], header=False)
    assert lines == ["  1   x     y", "  2   z", "  3"]


def test_key_values_right_aligns_the_keys() -> None:
    assert key_values([("loss", "0.5"), ("steps", "10")], align=">", sep=2) == [" loss  0.5", "steps  10"]
