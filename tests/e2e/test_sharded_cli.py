"""zero1, zero2 and hsdp as a user runs them (``paratrain train --strategy NAME``), held to the single-process
reference: the same losses and final parameters (their float64 norm) within float tolerance, the layout the
summary reports, and the at-rest bytes of the ZeRO formulas."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli
from tests.dist._reference import make_cfg, reference

# digits, a small MLP, AdamW (the default optimizer: the ZeRO formulas count its two moments)
FLAGS = ["--model", "mlp", "--set", "model.hidden=32", "--steps", "4", "--batch-size", "32"]
OVERRIDES = ["model.name=mlp", "model.hidden=32", "train.steps=4", "train.batch_size=32"]
CASES = [
    # strategy, ranks, extra flags, expected topology (dp_replicate, dp_shard), at-rest bytes formula
    ("zero1", 2, [], (1, 2), lambda psi, n: 8 * psi + 8 * psi / n),
    ("zero2", 2, [], (1, 2), lambda psi, n: 4 * psi + 12 * psi / n),
    ("hsdp", 4, ["--shard-size", "2"], (2, 2), lambda psi, n: 16 * psi / 2),  # 16Ψ/S with S = 2
]


@pytest.mark.e2e
@pytest.mark.slow  # ~50 s; the same strategies against one process stay fast in tests/dist/test_zero.py
@pytest.mark.timeout(600)
def test_zero1_zero2_hsdp_train_from_the_cli_like_one_process(tmp_path: Path) -> None:
    ref = reference(make_cfg(*OVERRIDES))
    ref_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in ref["params"].values()))
    for strategy, ranks, extra, (replicate, shard), formula in CASES:
        argv = ["train", *FLAGS, "--strategy", strategy, "--nproc-per-node", str(ranks), *extra, "--json"]
        proc = run_cli(*argv, "--run-dir", str(tmp_path / strategy), cwd=tmp_path, timeout=180)
        s = last_json(proc.stdout)
        what = f"{strategy} on {ranks} ranks"
        assert s["strategy"] == strategy and s["world_size"] == ranks and s["steps"] == 4, what
        topology = s["topology"]
        assert (topology["dp_replicate"], topology["dp_shard"]) == (replicate, shard), topology
        assert s["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-5), what
        assert s["param_norm"] == pytest.approx(ref_norm, rel=1e-5), what
        assert s["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-4), what
        psi = s["num_params"]
        expected = formula(psi, ranks)
        assert abs(s["model_state_bytes_per_rank"] - expected) <= 0.05 * expected + 16 * 1024, (what, s)
        # the peak during a step holds at least what stays at rest (parameters, gradients, optimizer state)
        assert s["peak_bytes_per_rank"] >= s["model_state_bytes_per_rank"], (what, s["peak_bytes_per_rank"])
        if s["device"] == "cpu":  # the caching allocator's figures are a GPU's alone
            assert s["cuda_peak_allocated_bytes_per_rank"] is None, s
