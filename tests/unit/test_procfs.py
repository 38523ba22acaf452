"""The one /proc parser: a zombie is dead, a reused pid is not the recorded process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from paratrain.procfs import child_pids, pid_alive, process_state, start_time


def test_running_zombie_and_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = start_time(child.pid)
        assert started is not None and pid_alive(child.pid) and pid_alive(child.pid, started)
        assert not pid_alive(child.pid, started + 1)  # another process that got the same pid
        assert child.pid in child_pids(os.getpid())
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_state(child.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "Z"  # exited, not reaped: a signal-0 probe would call it alive
        assert not pid_alive(child.pid) and start_time(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid) and process_state(child.pid) is None
