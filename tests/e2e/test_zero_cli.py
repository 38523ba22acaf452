"""The seed recipe (CNN with FSDP over all local ranks) as a user runs it, both ways, and bad sharding input
rejected before any process starts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env, last_json, run_cli


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_train_cnn_with_zero3_from_the_cli(tmp_path: Path) -> None:
    proc = run_cli(
        "train", "--model", "cnn", "--strategy", "fsdp", "--epochs", "5", "--json", cwd=tmp_path, timeout=170
    )
    s = last_json(proc.stdout)
    assert s["strategy"] == "zero3" and s["world_size"] == 2  # fsdp is an alias of zero3
    assert s["eval_accuracy"] >= 0.9
    assert s["losses"][-1] < s["losses"][0] / 4
    # measured from the local shards each rank holds: 16Ψ/N for fp32 AdamW, within 5% + a small constant
    psi = s["num_params"]
    assert abs(s["model_state_bytes_per_rank"] - 16 * psi / 2) <= 0.05 * 16 * psi / 2 + 16 * 1024
    assert len(s["param_sha256"]) == 64 and s["checkpoint"]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_fsdp_mnist_example_runs_on_digits(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paratrain",
            "launch",
            "--nproc-per-node",
            "2",
            str(REPO / "examples" / "fsdp_mnist.py"),
            "--epochs",
            "2",
            "--save-model",
            str(tmp_path / "cnn.pt"),
        ],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("epoch 1:") and lines[1].startswith("epoch 2:")
    assert float(lines[1].split("accuracy")[1].strip().rstrip("%")) > 60
    assert "on 2 rank(s)" in lines[-1]
    import torch

    full = torch.load(tmp_path / "cnn.pt", weights_only=True)  # full, unsharded state dict written by rank 0
    assert full["head.weight"].shape == (10, 64) and "blocks.0.net.0.weight" in full


@pytest.mark.e2e
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--strategy", "hsdp", "--nproc-per-node", "4", "--shard-size", "3"],
            "--shard-size 3 does not divide the data-parallel size 4",
        ),
        (["--strategy", "ddp", "--offload"], "does not work with strategy 'ddp'"),
        (["--strategy", "hsdp", "--nproc-per-node", "1"], "hsdp needs at least 2 data-parallel ranks"),
    ],
)
def test_bad_sharding_input_fails_before_any_worker(
    tmp_path: Path, cli_main: Callable[..., subprocess.CompletedProcess[str]], argv: list[str], message: str
) -> None:
    run_dir = tmp_path / "run"
    if "--shard-size" in argv:  # as a user runs it, a subprocess; the others from paratrain.cli.main
        proc = run_cli("train", *argv, "--run-dir", str(run_dir), cwd=tmp_path, check=False, timeout=80)
    else:
        proc = cli_main("train", *argv, "--run-dir", str(run_dir), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.count("error:") == 1  # one message, not one traceback per rank
    assert not run_dir.exists()  # nothing was started
