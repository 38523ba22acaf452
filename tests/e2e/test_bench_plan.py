"""benchmarks/bench_plan.py runs as documented: one training run per row, read against the planner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_bench_plan_one_rank_row_meets_its_targets_and_has_no_allocator_figure_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_plan.py"), "--nproc", "1", "--models", "mlp",
           "--strategies", "zero3", "--steps", "3", "--device", "cpu", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=170, check=False, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["gpu"] is None
    rows = {r["strategy"]: r for r in doc["rows"]}
    # one row (one training run): at one rank ddp's row would measure the same unsharded state again
    assert set(rows) == {"zero3"}, rows.keys()
    for name, row in rows.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["num_params"] == 26122  # the digits MLP: 64 -> 128 -> 128 -> 10
        # at one rank the state is parameters + gradients + AdamW's two moments, 16 B per parameter
        assert abs(row["state_meas"] - 16 * 26122) <= 1024, row["state_meas"]
        assert row["state_ok"] and row["peak_ok"], (name, row["state_ratio"], row["peak_ratio"])
        assert row["peak_meas"] >= row["state_meas"]
        assert row["cuda_peak_meas"] is None and row["cuda_peak_ratio"] is None
    # the bad flag is refused before any run
    bad = subprocess.run(
        [*cmd[:2], "--device", "tpu"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2 and "--device" in bad.stderr
