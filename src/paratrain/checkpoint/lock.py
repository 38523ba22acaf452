"""One writer per checkpoint directory, and the checks the launching process makes before any worker starts.

- :func:`preflight_checkpoint_dir`: a test write (create, write, fsync, remove a probe file), so that a
  read-only or missing directory is refused before training instead of at the first save.
- :func:`acquire_checkpoint_lock`: an exclusive ``flock`` on ``DIR/.lock``, taken by the launching
  process before launch and held until it exits (the kernel releases it when the holder dies, however it
  dies). The file records the holder ``{job_id, host, pid, pid_start, started}`` so that a refusal can
  name it. A second job on the same directory is refused with :class:`~paratrain.errors.ConfigError`. A
  stale lock is taken over with a warning: a record left by a holder that is gone (the lock is free), or
  a lock still held although the recorded process is dead on this host (an orphan that inherited the
  descriptor; the file is replaced, which breaks it).
- once the lock is held, :func:`remove_leftovers` deletes what dead jobs left behind: temporary step
  directories (``.step_N.tmp*``), replaced ones (``.step_N.old*``; restored instead when it is the only
  copy of that step) and temporary ``latest`` files. With the lock held nobody else can be writing them.

Reference: flock(2) — locks belong to the open file description and are released when it is closed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paratrain.checkpoint.integrity import COMMIT_FILE
from paratrain.checkpoint.layout import LATEST_FILE, step_of
from paratrain.errors import ConfigError
from paratrain.procfs import pid_alive, start_time

LOCK_FILE = ".lock"
_LEFTOVER_RE = re.compile(r"^(\.step_\d{8,}\.(tmp|old)(-.*)?|latest\.tmp(-.*)?|\.paratrain-probe-.*)$")


def _warn(message: str) -> None:
    print(f"paratrain: warning: {message}", file=sys.stderr, flush=True)


# ---- preflight ----------------------------------------------------------------------------------------------
def preflight_checkpoint_dir(path: str | Path) -> None:
    """Refuse a checkpoint directory that cannot be created or written, naming it (before any launch): also a
    committed step directory (or a directory inside one), where a run would write its own checkpoints into
    another's, and a ``latest`` that is not a file (the first commit could not replace it)."""
    d = Path(path)
    if d.exists() and not d.is_dir():
        raise ConfigError(
            f"checkpoint directory {d} exists and is not a directory. Give a directory as --ckpt-dir."
        )
    step = next(
        (x for x in (d, *d.parents) if (x == d or step_of(x) is not None) and (x / COMMIT_FILE).is_file()),
        None,
    )
    if step is not None:
        where = "is" if step == d else f"is inside {step}, which is"
        raise ConfigError(
            f"checkpoint directory {d} {where} a checkpoint step directory (it holds {COMMIT_FILE}); to resume "
            f"from it use --resume {step}, and give --ckpt-dir its parent or a new directory."
        )
    latest = d / LATEST_FILE
    if latest.is_dir() or (latest.exists() and not latest.is_file()):
        raise ConfigError(
            f"{latest} is a {'directory' if latest.is_dir() else 'special file'}: paratrain writes a file of that "
            "name after every save (it names the newest checkpoint), and could not replace it. Remove or rename "
            "it, or use another --ckpt-dir."
        )
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create checkpoint directory {d}: {e.strerror}. Give a writable --ckpt-dir (or --run-dir)."
        ) from None
    probe = d / f".paratrain-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"paratrain write test\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):
            probe.unlink()
        raise ConfigError(
            f"checkpoint directory {d} is not writable ({e.strerror}): no checkpoint could be saved. "
            "Give a writable --ckpt-dir (or --run-dir), or fix its permissions."
        ) from None


# ---- the lock -----------------------------------------------------------------------------------------------
def _proc_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (tells a reused pid from the original)."""
    return start_time(pid)


def _alive(pid: int, pid_start: int | None) -> bool:
    """The holder runs (a zombie holder has exited: its lock is stale) and is the recorded process."""
    return pid_alive(pid, pid_start)


def _describe(info: dict[str, Any]) -> str:
    since = info.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, int | float) else "?"
    )
    return f"job {info.get('job_id', '?')} (pid {info.get('pid', '?')} on host {info.get('host', '?')}) since {when}"


def _read_record(fd: int) -> dict[str, Any] | None:
    try:
        data = os.pread(fd, 1 << 16, 0)
        info = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return {"job_id": "?"}  # something unreadable: treated as a holder we cannot identify
    return info if isinstance(info, dict) else ({"job_id": "?"} if info is not None else None)


@dataclass
class LockHandle:
    """The held lock. Keep it referenced for the whole run; :meth:`release` (or process exit) frees it."""

    path: Path
    info: dict[str, Any]
    taken_over: dict[str, Any] | None = None
    """The record of the stale holder this lock was taken from, if any."""
    removed: list[str] = field(default_factory=list)
    """Leftovers of dead jobs removed (or restored) after the lock was taken."""
    _fd: int | None = field(default=None, repr=False)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Clear the record (so the next holder sees a clean release, not a stale lock) and unlock."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> LockHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def acquire_checkpoint_lock(
    directory: str | Path, job_id: str, warn: Callable[[str], None] | None = None
) -> LockHandle:
    """Take the exclusive lock on ``directory`` for job ``job_id`` (creating the directory), then remove
    leftovers of dead jobs. :class:`ConfigError` names the holder when another live job has it."""
    warn = warn or _warn
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create checkpoint directory {d}: {e.strerror}. Give a writable --ckpt-dir."
        ) from None
    path = d / LOCK_FILE
    for _ in range(5):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(
                f"cannot open the lock file {path} ({e.strerror}). Give a writable --ckpt-dir."
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd) or {"job_id": "?"}
            same_host = holder.get("host") == socket.gethostname()
            pid = holder.get("pid")
            if same_host and isinstance(pid, int) and not _alive(pid, holder.get("pid_start")):
                warn(
                    f"checkpoint directory {d} was locked by {_describe(holder)}, which is dead, but the lock is "
                    "still held by a process that inherited it; taking the lock over"
                )
                with contextlib.suppress(OSError):
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        os.unlink(path)  # the orphan keeps a lock on an unlinked file; we make a new one
                os.close(fd)
                continue
            os.close(fd)
            raise ConfigError(
                f"checkpoint directory {d} is in use by {_describe(holder)}; wait for it or use another "
                "--ckpt-dir"
            ) from None
        except OSError as e:
            os.close(fd)
            raise ConfigError(
                f"cannot lock {path} ({e.strerror}). Give a --ckpt-dir on a local or shared disk that supports flock."
            ) from None
        try:
            same_file = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same_file = False
        if not same_file:  # replaced between our open and our flock: lock the new one
            os.close(fd)
            continue
        previous = _read_record(fd)
        if previous is not None:
            warn(
                f"checkpoint directory {d}: taking over the stale lock of {_describe(previous)} (no longer running)"
            )
        info = {
            "job_id": job_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _proc_start(os.getpid()),
            "started": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        os.fsync(fd)
        handle = LockHandle(path, info, previous, _fd=fd)
        handle.removed = remove_leftovers(d, warn)
        return handle
    raise ConfigError(
        f"could not take the lock {path}: it keeps being replaced. Is another job starting on {d}?"
    )


def remove_leftovers(directory: str | Path, warn: Callable[[str], None] | None = None) -> list[str]:
    """Delete temporary directories/files of dead jobs; call only with the lock held. Returns their names.

    A ``.step_N.old*`` directory whose ``step_N`` is missing is the only copy of a committed checkpoint (a
    job died between the two renames of a re-save): it is renamed back instead of deleted.
    """
    d = Path(directory)
    out = []
    for p in sorted(d.iterdir()) if d.is_dir() else []:
        m = _LEFTOVER_RE.match(p.name)
        if m is None:
            continue
        if m.group(2) == "old":
            final = d / p.name[1:].split(".old", 1)[0]
            if not final.exists():
                os.rename(p, final)
                out.append(f"{p.name} -> {final.name}")
                continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()
        out.append(p.name)
    if out and warn is not None:
        warn(f"checkpoint directory {d}: removed what dead jobs left behind: {', '.join(out)}")
    return out
