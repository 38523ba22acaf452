"""benchmarks/bench_tree_latency.py runs as documented: correctness gate, JSON, plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_quick_run_writes_json_and_plot(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_tree_latency.py"), "--quick", "--json", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=110, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert printed == json.loads((tmp_path / "tree_latency.json").read_text())
    assert (tmp_path / "tree_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (res,) = printed["results"]
    assert res["world_size"] == 4 and res["hop_s"] > 0
    cells = {(r["collective"], r["algorithm"]) for r in res["rows"]}
    assert cells == {
        (c, a)
        for c in ("broadcast", "reduce", "all_reduce")
        for a in ("naive", "seed-star", "tree", "native")
    }
    assert all(r["synced_s"] > 0 and r["back_to_back_s"] > 0 for r in res["rows"])
