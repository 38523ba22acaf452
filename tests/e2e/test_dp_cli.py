"""`paratrain train --strategy dp` as a user runs it: ResNet on CIFAR-10 binary files written here, MNIST IDX,
and the bad inputs of the data-parallel features, each rejected (or warned about) with one clear message."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import last_json, run_cli
from tests.unit.test_loaders import write_cifar, write_idx


@pytest.mark.e2e
@pytest.mark.slow  # ~60 s; dp with every algorithm against one process stays fast (tests/dist/test_dp.py)
@pytest.mark.timeout(360)
def test_dp_ring_resnet_on_cifar10_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 96)
    # learnable: the image brightness encodes the label
    images = (labels[:, None, None, None] * 25 + rng.integers(0, 20, (96, 3, 32, 32))).clip(0, 255)
    write_cifar(tmp_path / "data_batch_1.bin", labels, images)
    write_cifar(tmp_path / "test_batch.bin", labels[:32], images[:32])
    common = [
        "train", "--json", "--model", "resnet18", "--set", "model.channels=4", "--data", f"cifar10:{tmp_path}",
        "--set", "data.augment=true", "--steps", "3", "--batch-size", "16", "--grad-accum", "2",
        "--activation-checkpointing",
    ]  # fmt: skip
    proc = run_cli(*common, "--strategy", "dp", "--comm-algorithm", "ring", "--run-dir", "run", cwd=tmp_path,
                   timeout=170)  # fmt: skip
    s = last_json(proc.stdout)
    assert s["strategy"] == "dp" and s["world_size"] == 2 and s["steps"] == 3
    assert len(s["losses"]) == 3 and all(np.isfinite(s["losses"]))
    assert s["grad_accum"] == 2 and 0.0 <= s["eval_accuracy"] <= 1.0
    # the same run with torch DDP (the same augmentation, SyncBatchNorm, accumulation, checkpointing): dp's
    # ring all-reduce must give the same training, up to float summation order
    ref = last_json(
        run_cli(*common, "--strategy", "ddp", "--run-dir", "run-ddp", cwd=tmp_path, timeout=170).stdout
    )
    assert s["losses"] == pytest.approx(ref["losses"], rel=1e-4, abs=1e-5)
    assert s["param_norm"] == pytest.approx(ref["param_norm"], rel=1e-5)
    assert s["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-3)
    assert ref["losses"][0] != ref["losses"][-1]  # it trained: a frozen model would match a frozen model
    # per-rank micro-batch 16 / (2 ranks x 2) = 4 < 16: SyncBatchNorm chosen, and the choice logged
    assert "sync-batchnorm: on (automatic: per-rank batch 4 < 16" in proc.stderr
    assert "activation checkpointing: 8 blocks" in proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_mnist_and_sync_batchnorm_warning(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 10, 64)
    x = rng.integers(0, 256, (64, 28, 28))
    write_idx(tmp_path / "train-images-idx3-ubyte", x)
    write_idx(tmp_path / "train-labels-idx1-ubyte", y)
    proc = run_cli(
        "train", "--json", "--strategy", "dp", "--model", "mlp", "--data", f"mnist:{tmp_path}",
        "--sync-batchnorm", "--steps", "2", "--batch-size", "16", "--run-dir", "run", cwd=tmp_path,
    )  # fmt: skip
    assert "warning: --sync-batchnorm has no effect: model 'mlp' has no BatchNorm layer" in proc.stderr
    s = last_json(proc.stdout)
    assert s["steps"] == 2 and s["num_params"] > 28 * 28 * 128


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs a CUDA GPU"),
        (["--batch-size", "20", "--grad-accum", "3"], "--grad-accum 3 does not divide the per-rank batch 10"),
        (["--strategy", "dp", "--comm-algorithm", "rign"], "invalid choice: 'rign'"),
        (  # a strategy that would ignore the algorithm refuses it instead
            ["--nproc-per-node", "2", "--strategy", "zero3", "--comm-algorithm", "shm"],
            "strategy zero3: --comm-algorithm 'shm' is not available; zero3 takes 'native'",
        ),
        (
            ["--model", "resnet", "--data", "cifar10"],
            "dataset 'cifar10' needs a directory: write --data cifar10:DIR",
        ),
    ],
)
def test_bad_input_fails_before_start(
    tmp_path: Path, cli_main: Callable[..., subprocess.CompletedProcess[str]], args: list[str], message: str
) -> None:
    if args[0] == "--precision":  # as a user runs it, a subprocess; the others from paratrain.cli.main
        proc = run_cli("train", "--steps", "1", *args, cwd=tmp_path, check=False, timeout=60)
    else:
        proc = cli_main("train", "--steps", "1", *args, cwd=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("summary.json"))
