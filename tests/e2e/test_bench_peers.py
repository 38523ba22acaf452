"""benchmarks/bench_peers.py runs its paratrain runners next to torch DDP (the peers themselves are optional
and not installed in CI), and its peak column counts the shm segment as training does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

RUNNERS = ("torch-ddp", "paratrain-ddp", "paratrain-dp+shm")


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_one_round_of_the_paratrain_runners_beside_torch_ddp(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_peers.py"), "--runners", ",".join(RUNNERS),
         "--rounds", "1", "--steps", "1", "--warmup", "1", "--out", str(out), "--json"],
        capture_output=True, text=True, env=env, timeout=170, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    # every paratrain runner built its trainer (they once all failed: each rank had its own run directory)
    assert result["raw"]["errors"] == {}, result["raw"]["errors"]
    rows = {r["runner"]: r for r in result["peers"]}
    assert set(rows) == set(RUNNERS)
    assert all(r["step_ms"] > 0 and r["peak_MB"] for r in rows.values())
    # a time is reported only for a runner that computed what torch DDP computed (the same steps, batches)
    assert all(r["param_rel_diff_vs_torch_ddp"] <= 1e-4 for r in rows.values()), rows
    # Parameters, momentum and gradients are 3 x 25.3 MB on every runner. dp+shm's gradients are its
    # buckets in the segment: counting the whole mapped segment (slots and both arenas) added ~76 MB.
    psi_mb = 4 * result["workload"]["params"] / 1e6
    assert (
        3 * psi_mb <= rows["paratrain-dp+shm"]["peak_MB"] <= rows["paratrain-ddp"]["peak_MB"] + 0.1 * psi_mb
    )
    # the dp+shm runner's gradients, mapped in the same processes, are not torch DDP's (they once added 4Ψ)
    assert abs(rows["torch-ddp"]["peak_MB"] - rows["paratrain-ddp"]["peak_MB"]) < 0.5 * psi_mb, rows
