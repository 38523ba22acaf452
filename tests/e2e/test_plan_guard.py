"""The plan guards every launch: ``paratrain train`` refuses, before any worker starts, a run whose predicted peak
per rank exceeds the device's memory, naming the figures and the cheapest change that fits; a run that fits
reports its predicted peak beside the measured one; ``--no-plan-check`` skips the check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from paratrain.config import RunConfig
from tests.conftest import last_json, run_cli


@pytest.mark.timeout(200)
def test_train_refuses_a_run_that_cannot_fit_and_names_the_fix(tmp_path: Path) -> None:
    proc = run_cli("train", "--model", "llama-debug", "--data", "python-stdlib", "--seq-len", "100000",
                   "--set", "model.max_seq_len=100000", "--batch-size", "64", "--steps", "1",
                   "--run-dir", str(tmp_path / "run"), cwd=tmp_path, check=False, timeout=180)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "per rank at its peak" in proc.stderr and "--no-plan-check" in proc.stderr
    assert "The cheapest change that fits: --activation-checkpointing" in proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()  # no worker ran


@pytest.mark.timeout(200)
def test_a_run_that_fits_shows_predicted_against_measured(tmp_path: Path) -> None:
    proc = run_cli("train", "--model", "llama-debug", "--data", "python-stdlib", "--set", "data.max_bytes=60000",
                   "--seq-len", "64", "--steps", "2", "--batch-size", "8", "--nproc-per-node", "2", "--strategy",
                   "zero3", "--json", "--run-dir", str(tmp_path / "run"), "--set", "checkpoint.save_at_end=false",
                   cwd=tmp_path, timeout=180)  # fmt: skip
    s = last_json(proc.stdout)
    predicted, measured = s["predicted_peak_bytes_per_rank"], s["peak_bytes_per_rank"]
    assert predicted > 0 and measured > 0
    assert 0.8 < predicted / measured < 1.25, (predicted, measured)


def test_no_plan_check_skips_the_guard() -> None:
    from paratrain.plan.guard import PREDICTED_ENV, check_launch

    cfg = RunConfig().override(["train.plan_check=false"])
    os.environ[PREDICTED_ENV] = "1"
    check_launch(cfg, 2, 2, object(), (8,), {"dp_replicate": 2}, False)  # no model is even looked at
    assert PREDICTED_ENV not in os.environ
