"""Preemption as a user (or Slurm) delivers it: a signal to the ``paratrain train`` launching process only.

The agent forwards SIGTERM/SIGUSR1 to its workers, which agree on a step, save a checkpoint there and exit;
the launcher then exits 0 with the summary (``stopped_by_signal``). Running the same command again resumes
exactly: the run, stopped twice (SIGTERM, then SIGUSR1), ends with the same ``param_sha256`` and the same
loss curve as an uninterrupted run (dropout on, so every rank's RNG stream must be restored too).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from paratrain.checkpoint.manager import check_checkpoint, list_checkpoints, step_of
from tests.conftest import cli_env, last_json, run_cli

pytestmark = pytest.mark.e2e

STEPS, EVERY = 500, 50
ARGS = [
    "train",
    "--model",
    "mlp",
    "--data",
    "digits",
    "--set",
    "model.dropout=0.1",
    "--batch-size",
    "64",
    "--steps",
    str(STEPS),
    "--nproc-per-node",
    "2",
    "--ckpt-every",
    str(EVERY),
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


def _signal_when_training(
    cwd: Path, run: Path, sig: signal.Signals, after_step: int, group: bool = False
) -> tuple[int, str, str]:
    """Start ``paratrain train``; once a checkpoint beyond ``after_step`` is committed (it is mid-run), send
    ``sig`` to the launching process only, or with ``group`` to it and then to its whole process group (as
    GNU ``timeout`` does). Returns (exit status, stdout, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain", *ARGS, "--run-dir", str(run)],
        cwd=cwd,
        env=cli_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not any((step_of(p) or 0) > after_step for p in list_checkpoints(run / "checkpoints")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 90 s"
            time.sleep(0.05)
        os.kill(proc.pid, sig)
        if group:
            os.killpg(proc.pid, sig)  # the launcher, the agent's workers: everyone gets it once more
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


def _check_stopped(run: Path, sig: signal.Signals, rc: int, out: str, err: str, after_step: int) -> int:
    assert rc == 0, err
    s = last_json(out)
    stop = s["steps"]
    assert s["stopped_by_signal"] == sig.name and after_step < stop < STEPS, (s["stopped_by_signal"], stop)
    assert f"{sig.name}: saved a checkpoint at step {stop} and stopped" in err
    ckpt = run / "checkpoints" / f"step_{stop:08d}"
    assert s["checkpoint"] == str(ckpt)
    assert check_checkpoint(ckpt) == []  # committed: marker present, every file complete
    assert (run / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert len(s["losses"]) == stop
    return stop


@pytest.mark.slow  # ~100 s; signal stop + exact resume stays in the fast tier (tests/dist/test_checkpoint.py)
@pytest.mark.timeout(240)
def test_sigterm_then_sigusr1_to_the_launcher_save_and_resume_exactly(tmp_path: Path, dist_run: Any) -> None:
    run = tmp_path / "run"
    rc, out, err = _signal_when_training(tmp_path, run, signal.SIGTERM, after_step=0)
    stop1 = _check_stopped(run, signal.SIGTERM, rc, out, err, after_step=EVERY - 1)

    rc, out, err = _signal_when_training(tmp_path, run, signal.SIGUSR1, after_step=stop1)
    stop2 = _check_stopped(run, signal.SIGUSR1, rc, out, err, after_step=stop1)
    assert last_json(out)["resumed_from_step"] == stop1

    got = last_json(run_cli(*ARGS, "--run-dir", str(run), cwd=tmp_path, timeout=120).stdout)
    assert got["resumed_from_step"] == stop2 and got["steps"] == STEPS and got["stopped_by_signal"] is None

    from paratrain.cli import build_config, make_parser

    cfg = build_config(
        make_parser().parse_args([*ARGS, "--resume", "never", "--run-dir", str(tmp_path / "ref")])
    )
    ref = dist_run(_uninterrupted, 2, cfg.to_json(), str(tmp_path / "ref"), timeout_s=120)[0]
    assert got["param_sha256"] == ref["param_sha256"]
    assert got["losses"] == ref["losses"]


@pytest.mark.timeout(150)
def test_sigterm_to_the_launcher_and_its_process_group_is_one_stop_request(tmp_path: Path) -> None:
    """``timeout``, ``kill -TERM -PGID`` and Slurm signal the launcher twice (directly and through its
    process group): that is one request to save and stop, not a second signal that escalates."""
    run = tmp_path / "run"
    rc, out, err = _signal_when_training(tmp_path, run, signal.SIGTERM, after_step=0, group=True)
    _check_stopped(run, signal.SIGTERM, rc, out, err, after_step=EVERY - 1)
    assert "did not all save" not in err
