"""Model parallelism as a user runs it: ``paratrain train --strategy fsdp+tp`` against ``single``, bad input
refused before any worker starts, and seed 004's example under ``paratrain launch`` and plain torchrun."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli

pytestmark = pytest.mark.e2e

SMALL = [
    "--model", "llama-debug", "--data", "python-stdlib", "--set", "data.max_bytes=100000", "--seq-len", "32",
    "--set", "model.n_layers=4", "--set", "model.dim=32", "--set", "model.ffn_hidden=64",
    "--steps", "4", "--batch-size", "8", "--lr", "0.01",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fsdp_tp_on_4_ranks_matches_single(tmp_path: Path) -> None:
    single = last_json(
        run_cli(
            "train", *SMALL, "--strategy", "single", "--nproc-per-node", "1", "--json", cwd=tmp_path
        ).stdout
    )
    proc = run_cli(
        "train", *SMALL, "--strategy", "fsdp+tp", "--nproc-per-node", "4", "--tp", "2", "--json",
        cwd=tmp_path, timeout=200,
    )  # fmt: skip
    s = last_json(proc.stdout)
    assert s["topology"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2}
    assert s["losses"] == pytest.approx(single["losses"], rel=1e-4)
    assert s["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4)
    assert s["param_norm"] == pytest.approx(single["param_norm"], rel=1e-4)
    # every rank holds a quarter of the parameters, gradients and AdamW moments (16 bytes per parameter)
    assert s["model_state_bytes_per_rank"] == pytest.approx(16 * s["num_params"] / 4, rel=0.05)


BAD = {
    "heads": (["--strategy", "tp", "--nproc-per-node", "3"], "does not divide the heads"),
    "pp>layers": (
        ["--strategy", "pp", "--nproc-per-node", "4", "--set", "model.n_layers=3"],
        "the pipeline has 4 stages but the model has 3 layers",
    ),
    "degrees": (
        ["--strategy", "fsdp+tp", "--nproc-per-node", "4", "--tp", "3"],
        "does not divide the world size 4",
    ),
    "text-path": (
        ["--strategy", "tp", "--nproc-per-node", "2", "--data", "text:/nonexistent/corpus"],
        "does not exist",
    ),
    "tied+pp": (
        ["--strategy", "pp", "--nproc-per-node", "2", "--set", "model.tie_embeddings=true"],
        "tie_embeddings",
    ),
    "tied+tp": (
        ["--strategy", "fsdp+tp", "--nproc-per-node", "2", "--tp", "2", "--set", "model.tie_embeddings=true"],
        "cannot share one weight (model.tie_embeddings=true)",
    ),
    "ffn": (
        ["--strategy", "tp", "--nproc-per-node", "2", "--set", "model.ffn_hidden=191"],
        "does not divide the feed-forward width (model.ffn_hidden=191)",
    ),
    "tp-1": (
        ["--strategy", "tp", "--tp", "1", "--nproc-per-node", "2"],
        "strategy 'tp' splits the model over its tp axis, but --tp 1 was given",
    ),
    "set-pp-1": (
        ["--strategy", "fsdp+tp+pp", "--set", "strategy.pp=1", "--nproc-per-node", "4"],
        "--pp 1 was given, which would run it without that axis. Give a degree above 1 that divides the 4 "
        "ranks, or use --strategy fsdp+tp.",
    ),
    "compile+tp": (
        ["--strategy", "fsdp+tp", "--nproc-per-node", "2", "--tp", "2", "--compile"],
        "--compile does not work with tensor parallelism yet (strategy 'fsdp+tp', tp 2)",
    ),
    "mp-flags-on-ddp": (
        ["--strategy", "ddp", "--nproc-per-node", "2", "--loss-parallel", "--microbatches", "3"],
        "--loss-parallel applies to tensor parallelism, which strategy 'ddp' does not have",
    ),
    "seq-len/sp": (
        ["--strategy", "tp", "--nproc-per-node", "2", "--seq-len", "33"],
        "--seq-len 33 does not split into --tp 2 equal parts",
    ),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_model_parallel_input_fails_before_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    args, message = BAD[case]
    base = [
        "--model",
        "llama-debug",
        "--data",
        "python-stdlib",
        "--set",
        "data.max_bytes=100000",
        "--steps",
        "2",
    ]
    t0 = time.monotonic()
    if case == "heads":  # as a user runs it, a subprocess
        proc = run_cli("train", *base, *args, cwd=tmp_path, timeout=80, check=False)
        rc, err = proc.returncode, proc.stderr
    else:  # the same refusal from paratrain.cli.main in this process: no interpreter and torch start each
        from paratrain.cli import main

        monkeypatch.chdir(tmp_path)
        try:
            rc = main(["train", *base, *args])
        except SystemExit as e:  # argparse's refusals
            rc = e.code
        err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err
    assert "Traceback" not in err and "rank" not in err.split(message)[0]
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, err
    assert not (tmp_path / "runs").exists()  # no run directory: nothing was launched
    assert time.monotonic() - t0 < 60


def _example(launcher: list[str], tmp_path: Path) -> str:
    proc = subprocess.run(
        [*launcher, str(REPO / "examples" / "fsdp_tp_llama.py"), "--steps", "3", "--max-bytes", "60000",
         "--seq-len", "32", "--batch-size", "8"],
        cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp_tp_example_runs_under_paratrain_launch(tmp_path: Path) -> None:
    out = _example([sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", "4"], tmp_path)
    assert "step 1: loss" in out
    assert "on 4 rank(s) as dp 2 x tp 2" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_fsdp_tp_example_runs_under_plain_torchrun(tmp_path: Path) -> None:
    out = _example([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"], tmp_path)
    assert "on 4 rank(s) as dp 2 x tp 2" in out


@pytest.mark.timeout(240)
def test_zero2_run_prints_no_torch_warning_noise(tmp_path: Path) -> None:
    """zero2's freed gradients made MemTracker warn on every rank. (fsdp+tp's warning, DTensor's '2 sequential
    all_gather operations' when the summary gathers (_StridedShard, Shard) parameters, is checked on the
    fsdp+tp run of tests/e2e/test_user_code.py, which holds that run to ``single`` through the CLI.)"""
    zero2 = run_cli("train", "--model", "cnn", "--strategy", "zero2", "--nproc-per-node", "2", "--steps", "2",
                    "--run-dir", "b", cwd=tmp_path, timeout=200)  # fmt: skip
    assert "traceable wrapper-subclass" not in zero2.stderr, zero2.stderr[-2000:]
    assert "Warning" not in zero2.stderr, zero2.stderr[-3000:]


@pytest.mark.timeout(240)
def test_a_one_step_pipeline_run_is_measured_on_its_first_step(tmp_path: Path) -> None:
    """With one step to run, the memory tracker measures the first step, inside which torch's pipeline stage
    infers its gradients' shapes with ``autograd.grad``; the tracker's module hooks made every pipeline strategy
    fail there. The run finishes with the single-process loss and a measured peak."""
    one = [*SMALL[:-6], "--steps", "1", "--batch-size", "8", "--json"]
    ref = last_json(
        run_cli("train", *one, "--strategy", "single", "--run-dir", "a", cwd=tmp_path, timeout=200).stdout
    )
    pp = last_json(run_cli("train", *one, "--strategy", "pp", "--nproc-per-node", "2", "--run-dir", "b",
                           cwd=tmp_path, timeout=200).stdout)  # fmt: skip
    assert pp["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert pp["peak_bytes_per_rank"] > pp["model_state_bytes_per_rank"] > 0
