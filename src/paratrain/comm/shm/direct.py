"""The direct path of the shared-memory communicator: ranks read (and write) each other's tensors where they
lie with ``process_vm_readv``/``process_vm_writev`` between two barriers (ARRIVE, DONE), instead of copying
through the segment's slots. Which path a call takes is decided in :mod:`.communicator` (``_route``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from paratrain.comm.shm.flags import _Flags
from paratrain.comm.shm.ops import (
    _bounds_hash,
    _esize,
    _reduce_rows,
    _signature,
    _with_seq,
    divide_,
    pairwise,
)
from paratrain.comm.shm.segment import _ADDR, _ALIGN, _ARRIVE, _DONE


class _DirectPath(_Flags):
    """The collectives over peers' memory; :class:`~paratrain.comm.shm.communicator.ShmCommunicator` adds the
    slot protocol and the choice between the two."""

    def _begin_direct(
        self, function: str, sig: list[int], addr: int, meanwhile: Callable[[], Any] | None = None
    ) -> tuple[int, tuple[str, int, int]]:
        """Publish this rank's tensor address with ARRIVE, wait for every rank, compare the signatures.
        ``meanwhile`` (work on this rank's own memory only) runs between the publish and the wait."""
        what = (function, 0, 1)
        k, _ = self._next()
        self._lines[self.rank, _ADDR] = addr
        self._publish(_ARRIVE, k, _with_seq(sig, k))
        if meanwhile is not None:
            meanwhile()
        self._wait(_ARRIVE, k, what)
        self._check_sig(k, _with_seq(sig, k))
        return k, what

    def _end_direct(self, k: int, what: tuple[str, int, int]) -> None:
        """DONE barrier: after it no peer reads this rank's memory, so the caller may change it."""
        self._publish(_DONE, k)
        self._wait(_DONE, k, what)

    def _reduce_chunk_direct(
        self, addrs: list[int], lo: int, hi: int, own: torch.Tensor, out: torch.Tensor, op: str,
        what: tuple[str, int, int], write_back: bool = False,
    ) -> None:  # fmt: skip
        """``out`` = the reduction of elements [lo, hi) of every rank's flat tensor (rank j's at
        ``addrs[j]``, this rank's is ``own``; ``out`` may be ``own[lo:hi]``), block by block: the peers'
        blocks are read into a private buffer that stays in cache, then combined with this rank's.
        ``write_back``: each reduced block is also written into every peer's tensor, where it was read
        from, while it is still in cache (the all-reduce)."""
        dtype, es, n, r = own.dtype, _esize(own.dtype), self.size, self.rank
        binary = pairwise(op, dtype)
        block = max(1, self.direct_block_bytes // max(1, n - 1) // es)
        rows = self._scratch_rows(dtype, min(block, max(1, hi - lo)))
        peers = [j for j in range(n) if j != r]
        for s in range(lo, hi, block):
            e = min(hi, s + block)
            m = e - s
            for i, j in enumerate(peers):
                self._peer_read(j, rows[i, :m], addrs[j] + s * es, what)
            dst = out[s - lo : e - lo]
            if binary is not None:  # in place over this rank's block: no copy of it
                binary(own[s:e], rows[0, :m], out=dst)
                for i in range(1, n - 1):
                    binary(dst, rows[i, :m], out=dst)
            else:
                rows[n - 1, :m].copy_(own[s:e])
                _reduce_rows(rows[:, :m], dst, op)
            if op == "mean":
                divide_(dst, n)
            if write_back:
                for j in peers:
                    self._peer_write(j, dst, addrs[j] + s * es, what)

    def _all_reduce_direct(self, flat: torch.Tensor, op: str) -> None:
        """Every rank reduces its 1/n chunk by reading the others' tensors where they lie (no copy into
        the segment), block by block, into its own tensor, and writes each reduced block into the others'
        tensors at once (``process_vm_writev``, the block still in cache): each rank moves about
        (n-1)/n·S in and (n-1)/n·S out, plus one reduction of S/n, between two barriers (ARRIVE, DONE).
        Rank j's chunk r is touched by rank r alone (read, then overwritten with the result), and no rank
        returns before every rank has written (DONE)."""
        n, r, dtype = self.size, self.rank, flat.dtype
        es, numel = _esize(dtype), flat.numel()
        grain = max(1, _ALIGN // es)
        q = -(-numel // n // grain) * grain
        bounds = [(min(numel, j * q), min(numel, (j + 1) * q)) for j in range(n)]
        sig = _signature("all_reduce", op, dtype, numel, -2, 0, 1)
        trace = self.trace
        if trace is not None:
            t0, c0 = time.perf_counter(), time.thread_time()
        k, what = self._begin_direct("all_reduce", sig, flat.data_ptr())
        if trace is not None:
            t1, c1 = time.perf_counter(), time.thread_time()
        addrs = [int(a) for a in self._lines[:, _ADDR]]
        a, c = bounds[r]
        if c > a:  # nobody else reads or writes my chunk of any tensor: reduce it in place
            self._reduce_chunk_direct(addrs, a, c, flat, flat[a:c], op, what, write_back=True)
        if trace is not None:
            t2, c2 = time.perf_counter(), time.thread_time()
        self._end_direct(k, what)
        if trace is not None:
            trace.append((t0, t1, t2, time.perf_counter(), c1 - c0, c2 - c1))

    def _reduce_scatter_direct(
        self, flat: torch.Tensor, bounds: list[tuple[int, int]], op: str, out: torch.Tensor
    ) -> None:
        sig = _signature("reduce_scatter", op, flat.dtype, flat.numel(), -2, _bounds_hash(
            [b - a for a, b in bounds]), 1)  # fmt: skip
        k, what = self._begin_direct("reduce_scatter", sig, flat.data_ptr())
        addrs = [int(a) for a in self._lines[:, _ADDR]]
        lo, hi = bounds[self.rank]
        if hi > lo:
            self._reduce_chunk_direct(addrs, lo, hi, flat, out, op, what)
        self._end_direct(k, what)

    def _all_gather_direct(
        self, mine: torch.Tensor, bounds: list[tuple[int, int]], out: torch.Tensor
    ) -> None:
        sig = _signature("all_gather", "", mine.dtype, out.numel(), -2, _bounds_hash(
            [b - a for a, b in bounds]), 1)  # fmt: skip
        lo, hi = bounds[self.rank]
        own = out[lo:hi]  # this rank's part is copied while the others arrive
        k, what = self._begin_direct("all_gather", sig, mine.data_ptr(), lambda: own.copy_(mine))
        addrs = [int(a) for a in self._lines[:, _ADDR]]
        for j, (a, c) in enumerate(bounds):
            if c > a and j != self.rank:
                self._peer_read(j, out[a:c], addrs[j], what)
        self._end_direct(k, what)

    def _broadcast_direct(self, flat: torch.Tensor, root: int) -> None:
        sig = _signature("broadcast", "", flat.dtype, flat.numel(), root, -2, 1)
        k, what = self._begin_direct("broadcast", sig, flat.data_ptr())
        if self.rank != root:
            self._peer_read(root, flat, int(self._lines[root, _ADDR]), what)
        self._end_direct(k, what)
