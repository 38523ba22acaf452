"""The MoE Llama as a user trains it: ``paratrain train --model llama-moe-debug`` under single, ddp and zero3
(equal loss curves, the aux loss in the training loss, the ``moe`` object of ``--json``), and refusals."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e

MOE = [
    "--model", "llama-moe-debug", "--data", "python-stdlib", "--set", "data.max_bytes=60000", "--seq-len", "32",
    "--set", "model.n_layers=2", "--steps", "4", "--batch-size", "8", "--lr", "0.003",
    "--set", "model.aux_loss_coef=0.01", "--set", "checkpoint.save_at_end=false", "--json",
]  # fmt: skip


def _runs(tmp_path: Path, strategies: tuple[tuple[str, str], ...]) -> dict[str, dict]:
    runs = {}
    for strategy, n in strategies:
        proc = run_cli(
            "train", *MOE, "--strategy", strategy, "--nproc-per-node", n, cwd=tmp_path, timeout=240
        )
        runs[strategy] = last_json(proc.stdout)
    return runs


@pytest.mark.timeout(300)
def test_moe_llama_trains_under_single_and_ep(tmp_path: Path) -> None:
    runs = _runs(tmp_path, (("single", "1"), ("ep", "2")))
    assert runs["ep"]["topology"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 1, "ep": 2}
    _check(tmp_path, runs)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_moe_llama_trains_under_ddp_and_zero3(tmp_path: Path) -> None:
    _check(tmp_path, _runs(tmp_path, (("single", "1"), ("ddp", "2"), ("zero3", "2"))))


def _check(tmp_path: Path, runs: dict[str, dict]) -> None:
    single = runs["single"]
    moe = single["moe"]
    assert len(moe["tokens_per_expert"]) == 2 and all(len(t) == 8 for t in moe["tokens_per_expert"])
    # every token of the last global batch is routed to top_k = 2 experts in each MoE layer
    assert all(sum(t) == 8 * 32 * 2 for t in moe["tokens_per_expert"])
    assert moe["dropped_fraction"] == 0.0 and moe["overload"] >= 1.0 and moe["aux_loss"] > 0
    for name in set(runs) - {"single"}:
        assert runs[name]["losses"] == pytest.approx(single["losses"], rel=1e-4)
        assert runs[name]["param_norm"] == pytest.approx(single["param_norm"], rel=1e-4)
        assert runs[name]["moe"]["tokens_per_expert"] == moe["tokens_per_expert"]
    metrics = [
        json.loads(line)
        for line in Path(tmp_path, single["run_dir"], "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["moe"]["tokens_per_expert"] for m in metrics if "moe" in m][-1] == moe["tokens_per_expert"]


BAD = {
    "ep-ranks": (["--strategy", "ep", "--ep", "3", "--nproc-per-node", "4"],
                 "--ep 3 does not divide the 4 data-parallel ranks it borrows from"),
    "ep-experts": (["--strategy", "ep", "--nproc-per-node", "4", "--set", "model.n_experts=6"],
                   "--ep 4 does not divide the model's 6 experts (model.n_experts=6)"),
    "ep-dense": (["--strategy", "fsdp+ep", "--nproc-per-node", "2", "--model", "llama-debug"],
                 "expert parallelism (--ep 2) splits the experts of a mixture-of-experts model"),
    "ep-ddp": (["--strategy", "ddp", "--ep", "2", "--nproc-per-node", "2"],
               "strategy 'ddp' does not do. Use --strategy ep or fsdp+ep"),
    "top-k": (["--strategy", "single", "--set", "model.top_k=9"], "model.top_k=9 must be between 1 and"),
}  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_moe_input_is_refused_before_launch(
    tmp_path: Path, cli_main: Callable[..., subprocess.CompletedProcess[str]], case: str
) -> None:
    args, message = BAD[case]
    if case == "ep-ranks":  # as a user runs it, a subprocess; the others from paratrain.cli.main
        proc = run_cli("train", *MOE, *args, cwd=tmp_path, check=False, timeout=100)
    else:
        proc = cli_main("train", *MOE, *args, cwd=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()
