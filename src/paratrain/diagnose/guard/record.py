"""The per-rank flight record: a fixed-size binary file that one worker writes and anyone can read.

Layout (little-endian): a 256-byte header, then a ring of ``RING`` entries of 256 bytes, one per recorded
collective (entry ``total`` lives in slot ``total % RING``). The worker maps the file (``mmap``) and writes
with ``struct.pack_into``: a record costs memory writes only, no system call, and the file survives the
worker (a rank killed by a signal still tells the launcher where it was). The launcher reads the file
twice and keeps the read only when both agree, so it never acts on a half-written record.

The same bytes (header plus the newest entries) are what a rank publishes in the c10d store in multi-node
jobs, where no single launcher sees every rank's file.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass, field

MAGIC = b"PTGUARD1"
RING = 128

# State of a rank (header field ``state``).
RUNNING, IN_COLLECTIVE, EXITED, FAILED = 0, 1, 2, 3
STATE_NAMES = {RUNNING: "running", IN_COLLECTIVE: "in a collective", EXITED: "exited", FAILED: "failed"}
# Entry flags.
ENTERED, DONE, ASYNC, ERROR = 1, 2, 3, 4

# magic, pid, rank, world, nslots, total, state, step, progress, t_change, t_where, where
_HEAD = struct.Struct("<8sqiiiqqqqdd160s")
_HEAD_SIZE = 256
_IDENT_AT = 16  # rank, world
_NSLOTS_AT = 24
# the part of the header that changes on every record: total, state, (step skipped), progress, t_change
_HOT = struct.Struct("<qq8xqd")
_HOT_AT = 28
_STEP_AT = 44
_WHERE = struct.Struct("<d160s")
_WHERE_AT = 68
# total, seq, gkey, sig, chain, t_enter, flags, t_exit, text
_ENTRY = struct.Struct("<qqIIIdid192s")
_ENTRY_SIZE = 256
_EXIT = struct.Struct("<id")  # flags, t_exit
# what the worker checked, written when it ends: desync checks made, guard warnings printed
_COUNTS = struct.Struct("<ii")
_COUNTS_AT = 236
_EXIT_AT = 36
SEP = "\x1f"  # between the op text, the call site and the group in ``text``

assert _HEAD.size <= _COUNTS_AT and _COUNTS_AT + _COUNTS.size <= _HEAD_SIZE and _ENTRY.size <= _ENTRY_SIZE


@dataclass
class Entry:
    """One recorded collective."""

    total: int
    """Index among all of this rank's recorded collectives (1, 2, ...)."""
    seq: int
    """Sequence number within its process group: what ranks compare."""
    gkey: int
    """crc32 of the process group's name; 0 for the default group."""
    sig: int
    """crc32 of the op and its shapes, dtypes and root: equal on every rank for a matching collective."""
    chain: int
    """crc32 over every signature of the group up to this one: differs if any earlier one differed."""
    flags: int
    t_enter: float
    t_exit: float
    op: str
    """e.g. ``all_reduce float32[4]``."""
    site: str
    """The user's call site, ``train.py:41``."""
    group: str
    """``""`` for the default group, else its ranks ``"0,2"``."""

    def describe(self) -> str:
        on = f" on group [{self.group}]" if self.group else ""
        return f"{self.op} at {self.site}{on}"


@dataclass
class RankView:
    """What one rank's record says, decoded."""

    rank: int
    pid: int
    world: int
    state: int
    step: int
    progress: int
    t_change: float
    where: str
    t_where: float
    entries: list[Entry] = field(default_factory=list)
    """Oldest first."""
    total: int = 0
    """Collectives this rank recorded (all of them, not only the ``entries`` kept in the ring)."""
    desync_checks: int = 0
    """Replica comparisons this rank took part in (written when the worker ends)."""
    warnings: int = 0
    """Guard warnings this rank printed (each is printed by one rank per job; written when it ends)."""

    @property
    def current(self) -> Entry | None:
        return self.entries[-1] if self.entries else None

    def last_in_group(self, gkey: int) -> Entry | None:
        for e in reversed(self.entries):
            if e.gkey == gkey:
                return e
        return None


def _fit(text: str, size: int) -> bytes:
    raw = text.encode("utf-8", "replace")
    return raw[:size]


class RecordWriter:
    """The worker side: one mapped file, written in place (``path=None``: anonymous memory)."""

    def __init__(self, path: str | None, rank: int, world: int, slots: int = RING) -> None:
        self.slots = slots
        size = _HEAD_SIZE + slots * _ENTRY_SIZE
        if path is None:
            self._buf = mmap.mmap(-1, size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)
                self._buf = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        self.total = 0
        self.state = RUNNING
        self.progress = 0
        _HEAD.pack_into(
            self._buf, 0, MAGIC, os.getpid(), rank, world, slots, 0, RUNNING, 0, 0, time.time(), 0.0, b""
        )

    def set_identity(self, rank: int, world: int) -> None:
        struct.pack_into("<ii", self._buf, _IDENT_AT, rank, world)

    def _hot(self, now: float) -> None:
        self.progress += 1
        _HOT.pack_into(self._buf, _HOT_AT, self.total, self.state, self.progress, now)

    def enter(self, seq: int, gkey: int, sig: int, chain: int, text: str | bytes, is_async: bool) -> int:
        """Record a collective being entered; returns its slot for :meth:`exit`."""
        raw = text if isinstance(text, bytes) else _fit(text, 192)
        self.total += 1
        slot = self.total % self.slots
        now = time.time()
        at = _HEAD_SIZE + slot * _ENTRY_SIZE
        if is_async:  # issued, not waited for: it cannot be where a rank hangs
            _ENTRY.pack_into(self._buf, at, self.total, seq, gkey, sig, chain, now, ASYNC, now, raw)
        else:
            _ENTRY.pack_into(self._buf, at, self.total, seq, gkey, sig, chain, now, ENTERED, 0.0, raw)
            self.state = IN_COLLECTIVE
        self._hot(now)
        return slot

    def exit(self, slot: int, ok: bool = True) -> None:
        now = time.time()
        _EXIT.pack_into(self._buf, _HEAD_SIZE + slot * _ENTRY_SIZE + _EXIT_AT, DONE if ok else ERROR, now)
        self.state = RUNNING
        self._hot(now)

    def tick(self, step: int | None = None) -> None:
        """Progress that is not a collective: a forward, an optimizer step."""
        if step is not None:
            struct.pack_into("<q", self._buf, _STEP_AT, step)
        self._hot(time.time())

    def set_counts(self, desync_checks: int, warnings: int) -> None:
        """What the worker checked, for the launcher's closing summary."""
        _COUNTS.pack_into(self._buf, _COUNTS_AT, desync_checks, warnings)

    def finish(self, state: int) -> None:
        self.state = state
        self._hot(time.time())

    def set_where(self, where: str) -> None:
        _WHERE.pack_into(self._buf, _WHERE_AT, time.time(), _fit(where, 160))

    def snapshot(self, last: int = 32) -> bytes:
        """Header plus the newest ``last`` entries: what a rank publishes in the c10d store."""
        buf = bytes(self._buf)
        n = min(last, self.slots, self.total)
        head = bytearray(buf[:_HEAD_SIZE])
        struct.pack_into("<i", head, _NSLOTS_AT, n)
        parts = [bytes(head)]
        for i in range(n):
            at = _HEAD_SIZE + ((self.total - i) % self.slots) * _ENTRY_SIZE
            parts.append(buf[at : at + _ENTRY_SIZE])
        return b"".join(parts)

    def close(self) -> None:
        try:
            self._buf.flush()
        except (ValueError, OSError):
            pass


def parse(buf: bytes) -> RankView | None:
    """Decode a record file or a store snapshot; ``None`` when it is not (yet) a record."""
    if len(buf) < _HEAD_SIZE or buf[:8] != MAGIC:
        return None
    _, pid, rank, world, nslots, recorded, state, step, progress, t_change, t_where, where = (
        _HEAD.unpack_from(buf)
    )
    desync_checks, warnings = _COUNTS.unpack_from(buf, _COUNTS_AT)
    entries = []
    for i in range(min(nslots, (len(buf) - _HEAD_SIZE) // _ENTRY_SIZE)):
        total, seq, gkey, sig, chain, t_enter, flags, t_exit, raw = _ENTRY.unpack_from(
            buf, _HEAD_SIZE + i * _ENTRY_SIZE
        )
        if total <= 0:
            continue
        text = raw.rstrip(b"\0").decode("utf-8", "replace")
        op, site, group = [*text.split(SEP), "", "", ""][:3]
        entries.append(Entry(total, seq, gkey, sig, chain, flags, t_enter, t_exit, op, site, group))
    entries.sort(key=lambda e: e.total)
    text = where.rstrip(b"\0").decode("utf-8", "replace")
    return RankView(
        rank,
        pid,
        world,
        state,
        step,
        progress,
        t_change,
        text,
        t_where,
        entries,
        recorded,
        desync_checks,
        warnings,
    )


def read_file(path: str, tries: int = 5) -> RankView | None:
    """Read a record another process is writing: two equal reads in a row, or ``None``."""
    last = None
    for _ in range(tries):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if data == last:
            return parse(data)
        last = data
    return None
