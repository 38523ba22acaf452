"""The segment at run time: views of slots and scratch, reading and writing peers' memory, the sequence-numbered
flags every collective publishes and waits on (with the liveness checks that name a dead or hung peer), the
per-call signature check, and the zero-copy arena. Creating and mapping the segment is :mod:`.segment`."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from paratrain.comm.shm.ops import _FUNCS, _describe, _esize
from paratrain.comm.shm.segment import (
    _ABORTED,
    _ARRIVE,
    _CLOSED,
    _DONE,
    _LINE_WORDS,
    _PID,
    _REDUCED,
    _SIG,
    _SIG_WORDS,
    _START,
    _STATUS,
    _STEP,
    _Mismatch,
    _Segment,
)
from paratrain.comm.shm.system import (
    CHECK_S,
    NAP_MAX_S,
    NAP_MIN_S,
    SPINS,
    YIELD_S,
    _align,
    _fence,
    _start_time,
)


class _Flags(_Segment):
    """The run-time half of the segment; :class:`~paratrain.comm.shm.direct._DirectPath` builds on it."""

    def _view(self, dtype: torch.dtype) -> torch.Tensor:
        t = self._typed.get(dtype)
        if t is None:
            t = self._typed[dtype] = self._u8.view(dtype)
        return t

    def _rows(self, dtype: torch.dtype, offset: int, stride: int, rows: int, length: int) -> torch.Tensor:
        """A (rows, length) view of the segment starting at byte ``offset``, rows ``stride`` bytes apart."""
        es = _esize(dtype)
        return self._view(dtype).as_strided((rows, length), (stride // es, 1), offset // es)

    def _slot(self, b: int, j: int) -> int:
        return self._slot_off + (b * self.size + j) * self.capacity_bytes

    def _slots(self, dtype: torch.dtype, b: int, start: int, length: int) -> torch.Tensor:
        """Elements [start, start+length) of every rank's slot of buffer b: an (n, length) view."""
        es = _esize(dtype)
        return self._rows(dtype, self._slot(b, 0) + start * es, self.capacity_bytes, self.size, length)

    def _scratch_rows(self, dtype: torch.dtype, length: int) -> torch.Tensor:
        """A private (n, length) buffer of this rank (kept for reuse), for the direct path."""
        t = self._scratch.get(dtype)
        if t is None or t.shape[1] < length:
            t = self._scratch[dtype] = torch.empty((self.size, length), dtype=dtype)
        return t[:, :length]

    def _peer_read(self, j: int, dst: torch.Tensor, remote: int, what: tuple[str, int, int]) -> None:
        """Copy ``dst.numel()`` elements from address ``remote`` of rank j's process into ``dst``
        (contiguous) with ``process_vm_readv``; a failure names the rank."""
        self._peer_copy(j, dst, remote, what, write=False)

    def _peer_write(self, j: int, src: torch.Tensor, remote: int, what: tuple[str, int, int]) -> None:
        """Copy the contiguous ``src`` to address ``remote`` of rank j's process (``process_vm_writev``)."""
        self._peer_copy(j, src, remote, what, write=True)

    def _peer_copy(
        self, j: int, t: torch.Tensor, remote: int, what: tuple[str, int, int], write: bool
    ) -> None:
        assert self._vm is not None
        move = self._vm.write if write else self._vm.read
        try:
            move(self._pids[j], t.data_ptr(), remote, t.numel() * t.element_size())
        except OSError as e:
            doing = "writing into" if write else "reading"
            raise RuntimeError(
                f"{self._where(what)}: {doing} rank {self.peers.global_rank(j)}'s tensor failed ({e}); "
                "the rank probably died"
            ) from None

    def _flat(self, dtype: torch.dtype, offset: int, length: int) -> torch.Tensor:
        es = _esize(dtype)
        return self._view(dtype)[offset // es : offset // es + length]

    # -- flags ---------------------------------------------------------------------------------------

    def _next(self) -> tuple[int, int]:
        self._seq += 1
        return self._seq, self._seq & 1

    def _publish(self, word: int, seq: int, sig: Sequence[int] | None = None) -> None:
        """Release: everything this rank wrote for step ``seq`` becomes visible before the flag does."""
        line = self._lines[self.rank]
        if sig is not None:
            base = _SIG + (seq & 1) * _SIG_WORDS
            line[base : base + _SIG_WORDS] = sig
        _fence()
        line[word] = seq
        if self._futex is not None:
            self._futex.wake(self._word_addr(self.rank, word))

    def _word_addr(self, j: int, word: int) -> int:
        """Address of the 32 low bits of rank j's ``word`` (the futex word)."""
        return self._lines_addr + (j * _LINE_WORDS + word) * 8 + (4 if sys.byteorder == "big" else 0)

    def _wait(self, word: int, seq: int, what: tuple[str, int, int]) -> None:
        """Acquire: return once every rank's ``word`` is >= ``seq``; raise naming the late ranks."""
        lines = self._lines
        late = [j for j in range(self.size) if lines[j, word] < seq]
        if late:
            self._wait_slow(word, seq, late, what)
        _fence()

    def _wait_slow(self, word: int, seq: int, late: list[int], what: tuple[str, int, int]) -> None:
        lines = self._lines
        start = time.monotonic()
        deadline, next_check, nap, spins = start + self.timeout_s, start + CHECK_S, NAP_MIN_S, 0
        while True:
            late = [j for j in late if lines[j, word] < seq]
            if not late:
                return
            spins += 1
            if spins <= SPINS:
                continue
            now = time.monotonic()
            if now - start < YIELD_S:
                os.sched_yield()
                continue
            if self._futex is not None:  # block until the first late rank raises its flag (or CHECK_S)
                value = int(lines[late[0], word])
                if value < seq:
                    timeout = max(1e-4, min(next_check, deadline) - now)
                    self._futex.wait(self._word_addr(late[0], word), value & 0xFFFFFFFF, timeout)
            else:
                time.sleep(nap)
                nap = min(2 * nap, NAP_MAX_S)
            now = time.monotonic()
            if now >= next_check:
                next_check = now + CHECK_S
                self._check_peers(late, word, seq, what)
            if now >= deadline:
                ranks = ", ".join(str(self.peers.global_rank(j)) for j in late)
                raise TimeoutError(
                    f"{self._where(what)}: rank {ranks} did not arrive within {self.timeout_s:g} s "
                    f"(waiting for its {_STEP[word]}{self._piece(what)})"
                )

    def _check_peers(self, late: list[int], word: int, seq: int, what: tuple[str, int, int]) -> None:
        """Raise naming a late rank that gave up, closed or died. A rank whose flag has reached ``seq`` since
        ``late`` was read is not late: it may have finished this call and closed its communicator while this
        rank slept (the flags stay set after a close), so its status is read first, then its flag."""
        for j in late:
            line = self._lines[j]
            g = self.peers.global_rank(j)
            status = int(line[_STATUS])
            _fence()
            if line[word] >= seq:
                continue
            if status == _ABORTED:
                raise RuntimeError(
                    f"{self._where(what)}: rank {g} gave up on this collective (it raised an error; see its "
                    "log), so it cannot complete"
                )
            if status == _CLOSED:
                raise RuntimeError(f"{self._where(what)}: rank {g} closed its shm communicator")
            pid, started = int(line[_PID]), int(line[_START])
            if pid and started and self._same_pidns and _start_time(pid) != started:
                raise RuntimeError(
                    f"{self._where(what)}: rank {g} (pid {pid}) died while the others waited for its "
                    f"{_STEP[word]}{self._piece(what)}; the collective cannot complete"
                )

    def _where(self, what: tuple[str, int, int]) -> str:
        return f"shm {what[0]} #{self._calls}"

    @staticmethod
    def _piece(what: tuple[str, int, int]) -> str:
        return f", piece {what[1] + 1} of {what[2]}" if what[2] > 1 else ""

    def _check_sig(self, seq: int, sig: Sequence[int]) -> None:
        """Compare every rank's call signature for the call that starts at step ``seq`` (after ARRIVE)."""
        base = _SIG + (seq & 1) * _SIG_WORDS
        table = self._lines[:, base : base + _SIG_WORDS]
        if bool((table == table[self.rank]).all()):
            return
        lines = [
            f"rank {self.peers.global_rank(j)}: {_describe(row.tolist())}" for j, row in enumerate(table)
        ]
        raise _Mismatch(
            f"shm {_FUNCS[sig[1]]}: the ranks of the group disagree on the call (every rank must call the "
            "same collective with the same op, root, dtype and size, in the same order):\n  "
            + "\n  ".join(lines)
        )

    @contextmanager
    def _call(self, function: str) -> Iterator[None]:
        """One collective call: refuse if closed, broken or re-entered; on an error that can leave ranks
        at different steps (anything but a mismatch, which every rank raises at the same step), mark this
        rank aborted so that its peers fail fast instead of timing out."""
        if self.closed:
            raise RuntimeError(f"shm {function}: the communicator is closed.")
        if self._broken is not None:
            raise RuntimeError(
                f"shm {function}: this communicator is unusable after an earlier failure ({self._broken}); "
                "create a new one on every rank."
            )
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(f"shm {function}: concurrent calls on one communicator (use one per thread).")
        self._calls += 1
        try:
            yield
        except _Mismatch as e:
            raise ValueError(str(e)) from None
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            if self._mm is not None:
                self._lines[self.rank, _STATUS] = _ABORTED
                if self._futex is not None:  # peers blocked on one of this rank's flags: look now
                    for word in (_ARRIVE, _REDUCED, _DONE):
                        self._futex.wake(self._word_addr(self.rank, word))
            raise
        finally:
            self._lock.release()

    # -- zero copy -----------------------------------------------------------------------------------

    def allocate(self, shape: int | Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new tensor inside this rank's arena (64-byte aligned; contents undefined), for
        :meth:`all_reduce_inplace_slot`. Local: every rank must allocate the same sequence of shapes and
        dtypes so that a tensor sits at the same arena offset on every rank (the call checks). Memory is
        handed out once; :meth:`reset_arena` starts over. With a group of one rank this is ``torch.empty``."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if self.size == 1:
            return torch.empty(shape, dtype=dtype)
        if self.closed:
            raise RuntimeError("shm allocate: the communicator is closed.")
        nbytes = math.prod(shape) * _esize(dtype)
        off = _align(self._arena_used)
        if off + nbytes > self.arena_bytes:
            raise ValueError(
                f"shm allocate: {nbytes} bytes do not fit in the arena ({self.arena_bytes - off} of "
                f"{self.arena_bytes} bytes left); create the communicator with a larger arena_bytes."
            )
        self._arena_used = off + nbytes
        return self._flat(dtype, self._arena(self.rank) + off, math.prod(shape)).view(shape)

    def reset_arena(self) -> None:
        """Forget every :meth:`allocate` (their tensors must no longer be used)."""
        self._arena_used = 0

    @property
    def arena_used(self) -> int:
        return self._arena_used

    def _arena(self, j: int) -> int:
        return self._arena_off + j * self.arena_bytes
