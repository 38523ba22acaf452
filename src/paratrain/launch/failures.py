"""A failed worker group, reported as one paragraph: the first failing rank, its error and where it was raised.

The agent's error files (``TORCHELASTIC_ERROR_FILE``, written by :func:`paratrain.runtime.record_errors`) are
read and sorted root cause first, instead of printing a traceback per rank.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any


class LaunchError(RuntimeError):
    """A worker group failed; ``str()`` names the first failing rank and its error."""

    def __init__(self, message: str, failures: list[RankFailure] | None = None, exit_code: int = 1) -> None:
        super().__init__(message)
        self.failures = failures or []
        self.exit_code = exit_code
        """The command's exit status: 130 after Ctrl-C (SIGINT), as a shell reports it; 1 otherwise."""


@dataclass
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int
    message: str
    traceback: str
    timestamp: int
    raised_at: float = 0.0  # when the rank caught its exception (record_errors), 0 if it recorded none

    @property
    def when(self) -> float:
        return self.raised_at or float(self.timestamp)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def read_failures(err: Any) -> list[RankFailure]:
    out = []
    for rank, f in err.failures.items():
        data = f.error_file_data.get("message", {}) if isinstance(f.error_file_data, dict) else {}
        raised_at = 0.0
        if isinstance(data, dict):
            msg = data.get("message", "") or ""
            extra = data.get("extraInfo") or {}
            tb = extra.get("py_callstack", "") or ""
            try:
                raised_at = float(extra.get("raised_at", 0.0))
            except (TypeError, ValueError):
                raised_at = 0.0
        else:
            msg, tb = str(data), ""
        if not msg or msg == "<NONE>" or msg.startswith("To enable traceback"):
            msg = _describe_exit(f.exitcode)
        out.append(RankFailure(rank, f.local_rank, f.exitcode, msg, tb, int(f.timestamp or 0), raised_at))
    return sorted(out, key=_root_cause_order)


def _noticed_a_dead_peer(f: RankFailure) -> bool:
    # the shared-memory transport's liveness check (comm/shm/segment.py, _check_peers) names the dead peer in
    # its own words, maybe wrapped by torch DDP's comm-hook future ("Unable to cast ... to Tensor")
    return (
        f.message.startswith("PeerLostError")
        or "stopped responding" in f.message
        or "died while the others waited" in f.message
    )


def _root_cause_order(f: RankFailure) -> tuple[int, float, int]:
    """Root cause first: a recorded exception, then a non-zero exit, then a signal; last, SIGTERM, which
    the agent itself sends to the surviving ranks once one has failed. A rank whose error only reports
    that a peer died (``PeerLostError``) comes after that peer: the dead rank is the headline. Among
    ranks that recorded an exception, the one that raised first leads (``raised_at``, to the microsecond;
    a rank that raised and was then SIGTERMed by the agent while it tore down still raised), then the
    lowest rank."""
    if f.traceback and not _noticed_a_dead_peer(f):
        kind = 0
    elif _noticed_a_dead_peer(f):
        kind = 2
    elif f.exitcode > 0:
        kind = 1
    elif f.exitcode == -signal.SIGTERM:
        kind = 3
    else:
        kind = 1
    return (kind, f.when, f.rank)


def format_failure(failures: list[RankFailure], attempts: int, notes: dict[int, str] | None = None) -> str:
    """One paragraph: the first failing rank, its error and where it was raised. ``notes`` (global rank ->
    text) is what the launcher saw and did to a rank (:class:`paratrain.launch.watch.WorkerWatch`: frozen,
    then killed): such a rank leads, and every rank's fate is listed."""
    if notes and any(f.rank in notes for f in failures):
        return _format_with_notes(failures, attempts, notes)
    first = failures[0]
    if first.exitcode < 0 and first.message == _describe_exit(first.exitcode):
        lines = [f"rank {first.rank} died ({first.message})"]  # no error of its own: killed
    elif first.traceback and first.exitcode == -signal.SIGTERM:
        # it raised, and the agent's SIGTERM (sent once another rank had exited) cut its teardown short:
        # the exception is the failure, the signal is not
        lines = [f"rank {first.rank} failed: {first.message}"]
    else:
        lines = [f"rank {first.rank} failed ({_describe_exit(first.exitcode)}): {first.message}"]
    frame = _last_frame(first.traceback)
    if frame:
        lines.append(f"  at {frame}")
    noticed = [f for f in failures[1:] if _noticed_a_dead_peer(f)]
    for f in noticed[:1]:
        lines.append(f"  rank {f.rank} then failed: {f.message}")
    others = [f.rank for f in failures[1:] if f not in noticed[:1]]
    if others:
        lines.append(f"  ranks {others} stopped after it.")
    if attempts > 0:
        lines.append(f"  (after {attempts} restart(s) by the elastic agent)")
    return "\n".join(lines)


def _format_with_notes(failures: list[RankFailure], attempts: int, notes: dict[int, str]) -> str:
    first = next(f for f in failures if f.rank in notes)
    lines = [f"rank {first.rank} was {notes[first.rank]}", "  what happened to each rank:"]
    for f in sorted(failures, key=lambda f: f.rank):
        if f.rank in notes:
            fate = notes[f.rank]
        elif f.exitcode == -signal.SIGTERM and not f.traceback:
            fate = "stopped by the agent's teardown (SIGTERM) after the failure"
        else:
            fate = f"exited ({_describe_exit(f.exitcode)}): {f.message}"
        lines.append(f"    rank {f.rank}: {fate}")
    if attempts > 0:
        lines.append(f"  (after {attempts} restart(s) by the elastic agent)")
    return "\n".join(lines)


_LIBRARY = re.compile(r'File "[^"]*/(site-packages|dist-packages|lib/python\d+\.\d+)/')


def _last_frame(tb: str) -> str:
    """Where the error was raised: the innermost frame, or, when that is inside an installed library (torch's
    ``linear.py`` for a shape mismatch), the innermost frame of the user's own code that called into it."""
    frames = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith('File "')]
    if not frames:
        return ""
    own = [f for f in frames if not _LIBRARY.match(f)]
    if not own or own[-1] == frames[-1]:
        return frames[-1]
    inner = re.match(r'File "[^"]*/(?:site|dist)-packages/([^"]+)", line (\d+)', frames[-1])
    where = f"{inner.group(1)}:{inner.group(2)}" if inner else frames[-1]
    return f"{own[-1]} (raised in {where})"
