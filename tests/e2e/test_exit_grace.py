"""A rank whose script succeeded must not abort at exit because a Gloo worker thread still wants the GIL.

The script below makes the hazard certain rather than likely: rank 0 starts a collective on a tensor
that wraps a Python buffer and drops every Python reference to it, so the Gloo worker thread holds the
last one and needs the GIL to free it. Rank 0 then keeps the GIL (a pure-Python spin, a 10 s switch
interval) until rank 1 says the collective is over, and exits. Without a grace the worker thread is still
waiting for the GIL at interpreter finalization, and the process dies with SIGABRT (rank 1, which exits
right after its own collective, often does too). The control run shows that; the others show that
``runtime.init``, a ``paratrain.comm`` call and ``launch --guard`` install the grace.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli_env

pytestmark = pytest.mark.e2e

SCRIPT = """
import mmap, sys, time
import torch, torch.distributed as dist
if sys.argv[1] == "runtime":
    from paratrain.runtime import init
    init(device="cpu")
else:
    dist.init_process_group("gloo")
if sys.argv[1] == "comm":
    from paratrain import comm
    comm.all_reduce(torch.ones(2), algorithm="ring")
flag = "flag.bin"
if dist.get_rank() == 0:
    with open(flag, "wb") as f:
        f.write(b"\\0")
dist.barrier()
with open(flag, "r+b") as f:
    mm = mmap.mmap(f.fileno(), 1)
if dist.get_rank() == 0:
    sys.setswitchinterval(10.0)
    dist.all_reduce(torch.frombuffer(bytearray(4000), dtype=torch.uint8), async_op=True)
    deadline = time.perf_counter() + 20.0
    while mm[0] == 0 and time.perf_counter() < deadline:  # mmap reads keep the GIL
        pass
    assert mm[0] == 1, "rank 1 never finished its all_reduce"
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:  # no print here: writing releases the GIL
        pass
else:
    time.sleep(0.05)
    dist.all_reduce(torch.zeros(4000, dtype=torch.uint8))
    mm[0] = 1
"""


def launch(tmp_path: Path, mode: str, *flags: str) -> tuple[int, str]:
    script = tmp_path / "exit_race.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "paratrain", "launch", *flags, "--device", "cpu", "--nproc-per-node", "2",
           str(script), mode]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=100)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.timeout(120)
def test_without_a_grace_the_rank_aborts_at_exit(tmp_path: Path) -> None:
    # The control: the hazard is real with this torch (if a torch release fixes it, this test says so).
    rc, out = launch(tmp_path, "plain")
    assert "never finished" not in out, out
    assert rc != 0 and "died (killed by signal SIGABRT)" in out, out


@pytest.mark.timeout(120)
def test_runtime_init_installs_the_exit_grace(tmp_path: Path) -> None:
    rc, out = launch(tmp_path, "runtime")
    assert rc == 0, out
    assert "terminate called" not in out, out


@pytest.mark.timeout(120)
def test_a_paratrain_comm_call_installs_the_exit_grace(tmp_path: Path) -> None:
    rc, out = launch(tmp_path, "comm")
    assert rc == 0, out
    assert "terminate called" not in out, out


@pytest.mark.timeout(120)
def test_launch_guard_installs_the_exit_grace(tmp_path: Path) -> None:
    rc, out = launch(tmp_path, "plain", "--guard")
    assert rc == 0, out
    assert "terminate called" not in out, out
