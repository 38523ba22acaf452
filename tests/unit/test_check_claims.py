"""benchmarks/check_claims.py: a stale figure, a figure missing from the document, and a README figure
without an index entry each fail; the repository's own index passes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location("check_claims", REPO / "benchmarks" / "check_claims.py")
assert _spec is not None and _spec.loader is not None
check_claims: Any = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_claims)


def _claim(tmp_path: Path, quote: str, values: list[float], **extra: Any) -> dict[str, Any]:
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"v": values}))
    return {"id": "x", "quote": quote, "json": str(result), "value": "doc['v']", **extra}


def test_a_range_must_match_the_json_at_the_quoted_precision(tmp_path: Path) -> None:
    texts = {"BENCHMARKS.md": "ring 1.02–1.15× here", "README.md": ""}
    ok, _ = check_claims.check(_claim(tmp_path, "1.02–1.15×", [1.0246, 1.1, 1.153]), texts)
    assert ok == []
    stale, _ = check_claims.check(_claim(tmp_path, "1.02–1.15×", [1.0246, 1.17]), texts)
    assert len(stale) == 1 and "states 1.15, the JSON gives 1.1700" in stale[0]


def test_bounds_negative_numbers_and_missing_quotes(tmp_path: Path) -> None:
    texts = {"BENCHMARKS.md": "within 0.04% and −0.004–+0.039", "README.md": ""}
    assert check_claims.check(_claim(tmp_path, "within 0.04%", [0.01, 0.039], kind="upper"), texts)[0] == []
    over = check_claims.check(_claim(tmp_path, "within 0.04%", [0.041], kind="upper"), texts)[0]
    assert over and "reaches 0.041" in over[0]
    assert check_claims.check(_claim(tmp_path, "−0.004–+0.039", [-0.004, 0.0392]), texts)[0] == []
    missing = check_claims.check(_claim(tmp_path, "2.0×", [2.0], readme=True), texts)[0]
    assert len(missing) == 2 and all("does not contain '2.0×'" in m for m in missing)


def test_a_readme_figure_needs_an_index_entry() -> None:
    readme = (
        "## Results\n\n| what | figure | c |\n|---|---|---|\n| a | 1.02–1.15× | 4 ranks |\n| b | 3.5× | x |\n"
    )
    bad = check_claims.readme_figures_unindexed(readme, [{"quote": "1.02–1.15×", "readme": True}])
    assert len(bad) == 1 and "'b'" in bad[0]


def test_the_repository_claims_hold() -> None:
    assert check_claims.main([]) == 0
