"""What a person sees: the progress bar on a terminal and not in a pipe; metrics.jsonl with one record per
logging step, as ``paratrain train`` writes them."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.conftest import cli_env, last_json, run_cli

pytestmark = pytest.mark.e2e

STEPS, LOG_EVERY = 5, 2
ARGS = ["train", "--strategy", "single", "--model", "mlp", "--set", "model.hidden=16", "--steps", str(STEPS),
        "--set", f"train.log_every={LOG_EVERY}", "--set", "checkpoint.save_at_end=false"]  # fmt: skip


def run_on_terminal(args: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """``python -m paratrain ARGS`` with stdin, stdout and stderr on a pseudo-terminal of 24 x 100; returns
    (exit code, everything written to the terminal)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal has a size
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", *args], cwd=cwd, env=cli_env(),
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True)  # fmt: skip
    os.close(slave)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has exited
                break
            if not data:
                break
            out += data
        else:
            proc.kill()
            raise AssertionError(f"paratrain {' '.join(args)} did not finish in {timeout} s:\n{out.decode()}")
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        os.close(master)


@pytest.mark.timeout(300)
def test_progress_bar_on_a_terminal_only_and_metrics_every_logging_step(tmp_path: Path) -> None:
    rc, screen = run_on_terminal([*ARGS, "--run-dir", str(tmp_path / "tty")], tmp_path, timeout=140)
    assert rc == 0, screen
    # tqdm redraws one line with carriage returns; it ends at the last step
    assert "train:" in screen and f"{STEPS}/{STEPS}" in screen and "\r" in screen, screen
    assert "step/s" in screen

    proc = run_cli(*ARGS, "--json", "--run-dir", str(tmp_path / "pipe"), cwd=tmp_path, timeout=140)
    assert "train:" not in proc.stderr and "step/s" not in proc.stderr, proc.stderr  # a pipe gets no bar
    summary = last_json(proc.stdout)
    assert len(summary["losses"]) == STEPS

    # one record per logging step (every LOG_EVERY steps, and the last), with that step's global loss
    records = [json.loads(line) for line in (tmp_path / "pipe" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    logged = [s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS]
    assert [r["step"] for r in train] == logged == [2, 4, 5]
    for r in train:
        assert r["loss"] == pytest.approx(summary["losses"][r["step"] - 1], rel=1e-6), r
