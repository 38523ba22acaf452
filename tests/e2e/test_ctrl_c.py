"""Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while ``paratrain train`` starts: exit
130 and one line from the launcher, no traceback from the workers (which get the same SIGINT, often while
they import torch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def _interrupt(tmp_path: Path, after_line: int, delay_s: float) -> tuple[int, str]:
    """Start a 2-rank run, wait for ``after_line`` lines of its output (0: none) and ``delay_s`` more, then
    SIGINT its process group; return the exit code and the whole output."""
    env = {**cli_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    cmd = [sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--strategy", "ddp",
           "--nproc-per-node", "2", "--steps", "100000", "--run-dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,  # its own group, as a terminal's foreground job
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(after_line)]
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + rest


@pytest.mark.parametrize(
    ("after_line", "delay_s"),
    [
        (1, 1.0),  # the workers are starting (importing torch)
        pytest.param(0, 0.5, marks=pytest.mark.slow),  # the launcher's own checks
        pytest.param(2, 0.5, marks=pytest.mark.slow),  # the workers' set-up / first steps
    ],
)
def test_ctrl_c_during_start_up_exits_130_with_one_line(
    tmp_path: Path, after_line: int, delay_s: float
) -> None:
    code, out = _interrupt(tmp_path, after_line, delay_s)
    assert code == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    ours = [line for line in out.splitlines() if line.startswith("paratrain train: ")]
    assert len(ours) == 1 and "interrupted" in ours[0], out
