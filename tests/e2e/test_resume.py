"""Crash, restart and resume exactly as a user runs them: ``paratrain train`` subprocesses."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e

COMMON = [
    "--model",
    "mlp",
    "--data",
    "synthetic-classification",
    "--set",
    "data.num_samples=512",
    "--set",
    "model.dropout=0.1",
    "--batch-size",
    "48",
    "--steps",
    "10",
    "--lr",
    "0.01",
    "--json",
]


def _uninterrupted(cfg_json: str, run_dir: str) -> dict[str, Any]:
    """The reference: the same job run in-process on every rank, never interrupted."""
    from paratrain.config import RunConfig
    from paratrain.runtime import init
    from paratrain.train.worker import train

    cfg = RunConfig.from_json(cfg_json)
    ctx = init("gloo", "cpu", 60.0, cfg.train.seed)
    return train(cfg, ctx, Path(run_dir)).summary()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("strategy", "resume"), [("ddp", "never"), pytest.param("zero3", "auto", marks=pytest.mark.slow)]
)
def test_killed_rank_restarts_and_ends_identical(
    strategy: str, resume: str, tmp_path: Path, dist_run: Any
) -> None:
    """The restart resumes from the job's newest checkpoint, also when the job itself started with
    ``--resume never`` (that applies to the first start only)."""
    args = [*COMMON, "--strategy", strategy, "--nproc-per-node", "2"]
    from paratrain.cli import build_config, make_parser

    cfg = build_config(
        make_parser().parse_args(["train", *args, "--resume", "never", "--run-dir", str(tmp_path / "ref")])
    )
    ref = dist_run(_uninterrupted, 2, cfg.to_json(), str(tmp_path / "ref"), timeout_s=90)[0]
    proc = run_cli(
        "train",
        *args,
        "--run-dir",
        str(tmp_path / "crash"),
        "--ckpt-every",
        "3",
        "--fail-at-step",
        "5",
        "--fail-rank",
        "1",
        "--max-restarts",
        "2",
        "--resume",
        resume,
        cwd=tmp_path,
        timeout=180,
    )
    got = last_json(proc.stdout)
    assert "rank 1 kills itself (SIGKILL) at step 5" in proc.stderr
    assert "rank 1 stopped responding" in proc.stderr  # the survivor named the dead peer
    assert got["restarts"] == 1 and got["resumed_from_step"] == 3
    assert got["param_sha256"] == ref["param_sha256"]
    assert got["losses"] == ref["losses"]  # the whole curve, including the steps before the crash


@pytest.mark.timeout(200)
def test_truncated_skipped_world_size_change_and_foreign_model_refused(tmp_path: Path) -> None:
    run = ["train", *COMMON, "--run-dir", str(tmp_path / "run")]
    run_cli(*run, "--steps", "6", "--ckpt-every", "3", "--nproc-per-node", "2", cwd=tmp_path)
    ckpts = tmp_path / "run" / "checkpoints"
    shard = ckpts / "step_00000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a torn write

    inspect = last_json(run_cli("ckpt", "inspect", str(ckpts), "--json", cwd=tmp_path).stdout)
    by_step = {c["step"]: c for c in inspect["checkpoints"]}
    assert by_step[3]["valid"] and not by_step[6]["valid"] and by_step[6]["world_size"] == 2
    assert inspect["resume_auto"].endswith("step_00000003")

    proc = run_cli(*run, "--nproc-per-node", "3", cwd=tmp_path, timeout=150)
    out = last_json(proc.stdout)
    assert "skipping checkpoint" in proc.stderr and "step_00000006" in proc.stderr
    assert out["world_size"] == 3 and out["resumed_from_step"] == 3 and out["steps"] == 10
    assert len(out["losses"]) == 10

    bad = run_cli(*run, "--nproc-per-node", "2", "--set", "model.hidden=64", cwd=tmp_path, check=False)
    assert bad.returncode == 2, bad.stderr
    assert "does not match this model" in bad.stderr
    assert bad.stderr.count("shape mismatch") >= 3  # every mismatching tensor is listed, in one message

    exported = tmp_path / "model.safetensors"
    run_cli("ckpt", "export", str(ckpts / "step_00000010"), str(exported), cwd=tmp_path)
    from safetensors.torch import load_file

    from paratrain.config import RunConfig
    from paratrain.models import build_model

    cfg = RunConfig().override(["model.name=mlp"])
    expect = {k: v.shape for k, v in build_model(cfg.model, (32,), 10).state_dict().items()}
    assert {k: v.shape for k, v in load_file(str(exported)).items()} == expect


TINY = ["--model", "mlp", "--data", "synthetic-classification", "--set", "data.num_samples=128",
        "--batch-size", "16", "--nproc-per-node", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One finished 4-step run with checkpoints at steps 2 and 4, trained once for the tests below; each
    test works on its own copy (:func:`_copy`), so none sees another's edits."""
    root = tmp_path_factory.mktemp("tiny")
    run_cli("train", *TINY, "--steps", "4", "--ckpt-every", "2", "--run-dir", str(root / "a"), cwd=root)
    assert (root / "a" / "checkpoints" / "step_00000002").is_dir()
    return root / "a"


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "a")
    return tmp_path / "a"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mistake", ["ckpt-dir is a step directory", "latest is a directory"])
def test_checkpoint_directory_mistakes_are_refused_before_launch(
    tmp_path: Path, mistake: str, tiny_run: Path, cli_main: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    """From paratrain.cli.main in this process (test_dataset_change_on_resume_is_refused_before_launch runs
    its refusal as a subprocess)."""
    step = _copy(tiny_run, tmp_path) / "checkpoints" / "step_00000004"
    before = sorted(p.name for p in step.rglob("*"))
    if mistake == "ckpt-dir is a step directory":
        args, expect = ["--ckpt-dir", str(step)], f"to resume from it use --resume {step}"
    else:
        (tmp_path / "b" / "checkpoints" / "latest").mkdir(parents=True)
        args, expect = [], "latest is a directory"
    proc = cli_main("train", *TINY, "--steps", "2", "--run-dir", str(tmp_path / "b"), *args, cwd=tmp_path)
    assert proc.returncode == 2 and expect in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "process(es)" not in proc.stderr  # refused before the workers were launched
    assert sorted(p.name for p in step.rglob("*")) == before
    assert not list((tmp_path / "b" / "checkpoints").glob("step_*"))


@pytest.mark.timeout(120)
def test_dataset_change_on_resume_is_refused_before_launch(tmp_path: Path, tiny_run: Path) -> None:
    run = _copy(tiny_run, tmp_path)
    proc = run_cli("train", *TINY, "--run-dir", str(run), "--steps", "6", "--set", "data.test_fraction=0.5",
                   cwd=tmp_path, check=False)  # fmt: skip
    lines = [ln for ln in proc.stderr.splitlines() if "paratrain" in ln]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "process(es)" not in proc.stderr and len(lines) == 1, proc.stderr  # one line, before any launch
    assert "was saved while training on 102 samples, and this run's training split has 64" in lines[0]


@pytest.mark.timeout(120)
def test_a_skipped_checkpoint_is_reported_once(tmp_path: Path, tiny_run: Path) -> None:
    """The launcher reports a damaged checkpoint before launch; rank 0 does not print it a second time."""
    run = _copy(tiny_run, tmp_path)
    shard = run / "checkpoints" / "step_00000004" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = run_cli("train", *TINY, "--ckpt-every", "2", "--run-dir", str(run), "--steps", "6", "--json",
                   cwd=tmp_path)  # fmt: skip
    assert last_json(proc.stdout)["resumed_from_step"] == 2
    skips = [ln for ln in proc.stderr.splitlines() if "skipping checkpoint" in ln]
    assert len(skips) == 1 and "step_00000004: __0_0.distcp does not match its checksum" in skips[0], (
        proc.stderr
    )
    assert "--resume auto" not in skips[0]
