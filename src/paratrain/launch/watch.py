"""The launcher's watch over its workers' processes: a frozen rank does not hold the job's teardown.

A rank that is stopped (SIGSTOP, ``kill -STOP``, a job-control stop) makes its peers fail at the
process-group timeout, naming it. torch's agent then tears the group down with SIGTERM and waits
``shutdown_timeout`` (30 s) before SIGKILL, but a stopped process does not run until it is continued, so
the teardown always waited those 30 s, and the frozen rank was reported as "killed by SIGKILL" as if it had
been an ordinary straggler. :class:`WorkerWatch` is a thread in the launcher that reads its children's
state from ``/proc`` every ``interval_s``: once a worker of a group has exited while another of the same
group is stopped, it SIGKILLs the stopped one at once and remembers what happened to every rank, for the
failure report (:func:`paratrain.launch.failures.format_failure`).

A process stopped by a debugger (``t``, tracing stop) is left alone: someone is looking at it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, field

from paratrain.procfs import child_pids, process_state


@dataclass
class _Worker:
    pid: int
    rank: int
    group: str
    stopped: bool = False


@dataclass
class WorkerWatch:
    """Watches this process's workers; :attr:`notes` says, per global rank, what the watch saw and did."""

    interval_s: float = 0.2
    notes: dict[int, str] = field(default_factory=dict)
    _seen: dict[int, _Worker] = field(default_factory=dict)
    _lost: dict[str, int] = field(default_factory=dict)
    """Per group, the first rank seen to have exited."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> WorkerWatch:
        if sys.platform.startswith("linux"):
            self._thread = threading.Thread(target=self._run, name="paratrain-worker-watch", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # the watch must never take the launcher down
                continue

    def poll(self) -> None:
        """One look at the workers: note the stopped ones, SIGKILL those whose group already lost a rank."""
        states = _child_states(os.getpid())
        for pid, state in states.items():
            if pid not in self._seen:
                info = _worker_identity(pid)
                if info is None:
                    continue
                self._seen[pid] = _Worker(pid, *info)
            self._seen[pid].stopped = state == "T"
        for pid, w in self._seen.items():
            if states.get(pid) in (None, "Z", "X"):
                self._lost.setdefault(w.group, w.rank)
        for pid, w in list(self._seen.items()):
            if states.get(pid) in (None, "X"):
                del self._seen[pid]  # reaped
                continue
            if not w.stopped or w.group not in self._lost:
                continue
            gone = self._lost[w.group]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            w.stopped = False
            self.notes[w.rank] = (
                f"frozen (process stopped, state T): killed by the launcher (SIGKILL) once rank {gone} "
                "had exited, instead of waiting for it to answer SIGTERM"
            )
            os.write(2, f"[paratrain] rank {w.rank} (pid {pid}) is frozen (stopped); rank {gone} "
                        "exited: killing it (SIGKILL)\n".encode())  # fmt: skip


def _child_states(pid: int) -> dict[int, str]:
    """``{child pid: one-letter state}`` of this process's children (``Z``: exited, not yet reaped)."""
    states = {child: process_state(child) for child in child_pids(pid)}
    return {child: state for child, state in states.items() if state is not None}


def _worker_identity(pid: int) -> tuple[int, str] | None:
    """``(global rank, group)`` of a worker from the environment the agent started it with; ``None`` for a
    child that is not a worker. The group is the rendezvous round (a restart starts a new one)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    except OSError:
        return None
    rank = env.get(b"RANK")
    if rank is None or not rank.isdigit():
        return None
    group = env.get(b"PARATRAIN_ROUND_KEY") or env.get(b"TORCHELASTIC_RESTART_COUNT") or b"0"
    return int(rank), group.decode(errors="replace")
