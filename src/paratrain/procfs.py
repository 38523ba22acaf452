"""Processes as Linux's ``/proc`` shows them: one parser of ``/proc/<pid>/stat`` and one liveness test.

A process that has exited but not been reaped (a zombie, state ``Z``) is dead for every purpose here: a
SIGKILLed worker, a crashed lock holder or a dead launcher can sit as a zombie until its parent waits for it,
and a signal-0 probe would call it alive. The start time (clock ticks since boot, field 22) tells a reused
pid from the process that was recorded. Standard library only; no torch.
"""

from __future__ import annotations

import os

__all__ = ["child_pids", "pid_alive", "process_age", "process_state", "start_time", "stat_fields"]


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` is the state, ``[19]`` the start
    time), or ``None`` when the process is gone or ``/proc`` cannot be read. The name may contain spaces and
    parentheses, so the split is after the last ``)``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields or None


def process_state(pid: int) -> str | None:
    """The one-letter state (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...), ``None`` when gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def start_time(pid: int | str) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; ``None`` when gone or a zombie."""
    fields = stat_fields(pid)
    if not fields or fields[0] in ("Z", "X", "x") or len(fields) < 20:
        return None
    return int(fields[19])


def pid_alive(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``started`` (:func:`start_time` when it was recorded),
    is still the same process. Without ``/proc`` (another OS), a signal-0 probe."""
    if pid <= 0:
        return False
    fields = stat_fields(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            return False  # /proc works and has no entry: gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X", "x"):
        return False
    return started is None or len(fields) < 20 or int(fields[19]) == started


def child_pids(pid: int) -> list[int]:
    """The children of ``pid`` (every thread's), from ``/proc/<pid>/task/*/children``."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def process_age() -> float:
    """Seconds since this process started (0 where unknown; capped at an hour): what the interpreter's
    start-up and imports cost, which ``paratrain doctor`` counts against its ``--timeout``."""
    try:
        fields = stat_fields("self")
        if fields is None:
            return 0.0
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
    except (OSError, ValueError, IndexError):
        return 0.0
    return min(max(0.0, uptime - started), 3600.0)
