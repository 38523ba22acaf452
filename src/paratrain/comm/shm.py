"""Collectives among the ranks of one host through one shared-memory segment per group (algorithm ``shm``).

    from paratrain.comm import shm
    shm.all_reduce(grad, op="mean")                 # in place, comm's conventions (group=None: world)
    part = shm.reduce_scatter(t, op="sum")          # torch.tensor_split(result, n)[rank] along dim 0
    full = shm.all_gather(shard)                    # every rank's tensor, dim 0, group-rank order
    shm.broadcast(param, src=0)                     # in place; src is a global rank, as in torch

    c = shm.ShmCommunicator(group, capacity_bytes=8 << 20, arena_bytes=64 << 20)
    c.reduce_scatter(out, inp, op="sum")            # torch's reduce_scatter_tensor semantics
    c.all_gather(out, inp)                          # torch's all_gather_into_tensor semantics
    bucket = c.allocate((numel,), torch.float32)    # lives in this rank's arena inside the segment
    ...; c.all_reduce_inplace_slot(bucket, "mean")  # zero copy: peers read the bucket where it lies

**Files.** This module: the protocol (this docstring), the collectives, the module-level functions.
:mod:`._shm_segment`: the segment (creation handshake, mapping, flags, waiting, zero-copy arena);
:mod:`._shm_sys`: fences, futex, process liveness, names, stale sweep; :mod:`._shm_ops`: reduction ops
and call signatures; :mod:`.shm_hier`: the hierarchical all-reduce over several hosts.

Gloo moves every byte of a one-host collective through TCP loopback (copy into a socket, copy out, a
kernel wake-up per message). Here the ranks map the same memory: a rank copies its input into its own
*slot*, raises a flag, and the others read it where it lies. No byte goes through a socket and no
Gloo round trip is on the fast path; synchronisation is sequence-numbered flags in the segment.

**Segment.** The group's rank 0 creates ``/dev/shm/paratrain-shm-<pidns>-<pid>-<token>-<job>-<group>``
(``O_EXCL``, mode 0600); its name travels through the c10d store of the process group (``store=`` to
use another), together with each rank's host name and boot id: ranks on different hosts are refused with
one ``ValueError`` on every rank. Every rank maps it and reports through the store; as soon as every
rank has mapped it, the name is **unlinked**.

**Cleanup strategy.** After the unlink the segment has no name: the kernel frees it when the last
mapping goes, on every exit path, SIGKILL and OOM-kill included, without any cleanup code running. The
only window in which a name exists is the creation handshake (well under a second). A creator killed
inside that window leaves a name behind; the next creation on the host sweeps names whose creator
(same pid namespace, pid in the name) no longer exists. :meth:`ShmCommunicator.close` (also called at
exit for the cached communicators) unmaps this rank's view early.

**Layout** (n ranks, C = ``capacity_bytes``, A = ``arena_bytes``; every region 64-byte aligned)::

    header   4 KiB+   one 256-byte line per rank: flags ARRIVE, REDUCED, DONE (int64, written only by
                      that rank, monotonically increasing), STATUS, pid, start time, two call signatures,
                      the direct path's tensor address; rank 0's also the paths it chose (_shm_tune)
    slots    2·n·C    two buffers (b = seq mod 2) of one C-byte slot per rank: inputs
    results  2·C      two buffers of reduced pieces (all_reduce / reduce): rank c writes chunk c
    arenas   n·A      one per rank, for :meth:`ShmCommunicator.allocate` (zero-copy buckets)

**Protocol.** Each rank counts *steps* (``seq``, one per piece of a collective, the same sequence on
every rank because collectives are called in the same order). A tensor larger than a slot is processed
in pieces that fit. For step k (buffer b = k mod 2) of an all-reduce, rank r:

1. copies its piece into ``slot[b][r]``, then sets ``ARRIVE[r] = k`` (first piece: the call signature
   is written before the flag);
2. waits until ``ARRIVE[j] >= k`` for every j (first piece: compares every rank's signature, so a
   mismatched call raises the same ``ValueError`` everywhere instead of corrupting memory);
3. reduces its 1/n chunk of the piece from every rank's slot with one torch op over a strided
   (n, chunk) view of the slots (``torch.sum(dim=0)``, ``amax``...) into ``result[b]``, then sets
   ``REDUCED[r] = k``;
4. waits until ``REDUCED[j] >= k`` for every j, and copies ``result[b]`` into its tensor.

Small all-reduces (``SMALL_BYTES``) skip 3–4: after step 2 every rank reduces the whole piece itself,
one barrier instead of two. reduce_scatter is 1–2 and then reduces its own chunk straight into the
output; all_gather and broadcast are 1–2 and then copy out of the slots. Every step starts with the
ARRIVE barrier, and that is what makes the two buffers safe to reuse without another flag: rank r
writes ``slot[b][r]`` (and ``result[b]``) again at step k+2 only after it has seen ``ARRIVE[j] >= k+1``
for every j, and rank j raises ARRIVE to k+1 only after it has finished every read of step k. The same
argument lets a fast rank copy in piece k+1 while slow ranks still read piece k (pipelining across
ranks). The zero-copy arena is the exception (the caller writes it at will after the call), so
:meth:`all_reduce_inplace_slot` ends with a third barrier on ``DONE``.

**Direct path** (cross-memory attach). Where the kernel allows it, tensors above 256 KiB may skip the
slots; which path a call takes is measured per collective and power-of-two size class on the first calls
of each (:mod:`._shm_tune`: the slots' ``memcpy`` wins while the tensors are in cache on some hosts, the
direct path's fewer bytes on others), or fixed by ``direct_min_bytes``. On the direct path each rank
publishes its tensor's address in its header line with ARRIVE, and the others copy straight out of its
address space with ``process_vm_readv(2)`` (one kernel copy, as MPI implementations do on one host).
all_reduce: rank r reads block by block every peer's chunk r into a private cache-sized buffer, combines
it with its own chunk in place, and writes the reduced block back into every peer's chunk r with
``process_vm_writev(2)`` while it is in cache; then a ``DONE`` barrier (after it no peer reads or writes
this rank's memory). Chunk r of every rank's tensor is touched by rank r alone, so no other barrier is
needed. Per rank that is
(n−1)/n·S read in, S/n reduced, (n−1)/n·S written out, against the slots' copy in (S), reduction and copy
out (S). reduce_scatter and all_gather read the peers' inputs the same way; broadcast reads the root's
tensor. Whether the direct path is available at all is decided once, collectively, when the
communicator is created: every rank must want it (``direct=True``, ``PARATRAIN_SHM_DIRECT`` not ``0``),
all must share one pid namespace, and each must
read (and write back) a probe word of the next rank successfully. Same-user processes may read each other
unless Yama's ``ptrace_scope`` forbids it; at scope 1 every rank allows its peers with
``prctl(PR_SET_PTRACER_ANY)`` (scope 2 and 3 refuse, and the slots are used). A peer that dies mid-call
makes the read fail with ``ESRCH``, which names it.

**Waiting.** A rank polls the flags it waits for: a few µs of pure spinning, then ``sched_yield`` for
up to ``YIELD_S``, then it blocks in ``futex(FUTEX_WAIT)`` on the first late rank's flag word, and every
publisher calls ``FUTEX_WAKE`` on its flag after raising it (the kernel rechecks the value under its own
lock, so no wake-up is lost). Up to 4–5 ranks share 2 cores on the development machine: pure spinning
would starve the very peers a rank waits for, and sleep-polling (the fallback without futex, sleeps
doubling from ``NAP_MIN_S`` to ``NAP_MAX_S``) adds its nap to every late arrival. While blocked it
checks, every ``CHECK_S``, whether a late rank has died (``/proc/<pid>``, guarded against pid reuse by
the start time) or given up (its STATUS word), and raises naming it; after ``timeout_s``
(default: the process group's timeout) it raises ``TimeoutError("shm all_reduce #k: rank 2 did not
arrive within 30 s ...")``. A rank that raised marks itself aborted, so its peers fail fast too; the
communicator is unusable afterwards (collective state is lost), like a process group after a timeout.

**Memory ordering.** A writer stores the data (torch kernels), then the flag (an aligned numpy int64
store, single-copy atomic on x86-64 and AArch64). A reader sees the flag, then loads the data. On x86-64
(TSO: stores are not reordered with stores, loads not with loads, and the interpreter between the two
C calls is a compiler barrier) that is enough. Other architectures get ``atomic_thread_fence(seq_cst)``
from libatomic before every flag store and after every flag load (release/acquire); a communicator of
two or more ranks refuses to start on a non-x86 machine without libatomic.

**Ops and dtypes.** ``sum mean max min prod`` (comm's ops), ``avg`` (= mean), ``band bor bxor`` (integer
and bool), or the equivalent ``dist.ReduceOp``, and ``PREMUL_SUM`` from
``dist._make_nccl_premul_sum(factor)`` (floats: each rank's input times the factor, then the sum; all_reduce
scales its tensor in place first, reduce and reduce_scatter scale a copy, as their inputs are kept).
Reductions take any dtype torch can reduce on CPU with that op: sums of bf16/fp16 are accumulated in
float32 and rounded once; integers wrap like Gloo's; bool follows Gloo (sum/max/bor = any, prod/min/band
= all, bxor = parity). A dtype/op pair torch has no CPU kernel for (float8, most ops on uint16/32/64) is
refused with a ``TypeError`` before the call starts (tried once on a tiny tensor, then cached), so the
communicator stays usable; all_gather and broadcast only copy, and take any dtype. Any shape, 0-d,
empty, non-contiguous (through a copy).
Tensors on another device are staged through the segment by ``copy_``.

**Hierarchical all-reduce** (:func:`hierarchical_all_reduce`): node-local shm reduce-scatter, a native
all-reduce of the chunk among the ranks with the same local index, node-local shm all-gather.
"""

from __future__ import annotations

import atexit
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._common import chunk_bounds
from paratrain.comm._shm_ops import (
    OPS,
    _bounds_hash,
    _esize,
    _reduce_rows,
    _signature,
    _with_seq,
    check_op,
    divide_,
    native_op,
    normalize_op,
    pairwise,
    premultiply,
    split_premul,
)
from paratrain.comm._shm_segment import (
    _ADDR,
    _ALIGN,
    _ARRIVE,
    _DONE,
    _REDUCED,
    DEFAULT_CAPACITY_BYTES,
    DIRECT_MIN_BYTES,
    IN_PLACE_BLOCK_BYTES,
    SMALL_BYTES,
    _Segment,
    transport_storages,
)
from paratrain.comm._shm_sys import SEGMENT_PREFIX
from paratrain.comm._shm_tune import FUNCTIONS as TUNED_FUNCTIONS
from paratrain.comm.shm_hier import (
    HierarchicalAllReduce,
    hierarchical_all_reduce,
    make_hierarchical_groups,
    node_groups,
)

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DIRECT_MIN_BYTES",
    "OPS",
    "SEGMENT_PREFIX",
    "SMALL_BYTES",
    "HierarchicalAllReduce",
    "ShmCommunicator",
    "all_gather",
    "all_reduce",
    "broadcast",
    "check_op",
    "close_all",
    "get_communicator",
    "hierarchical_all_reduce",
    "make_hierarchical_groups",
    "native_op",
    "node_groups",
    "normalize_op",
    "reduce",
    "reduce_scatter",
    "transport_storages",
]


class ShmCommunicator(_Segment):
    """Shared-memory collectives among the ranks of ``group`` (all on one host). Creating one is
    collective: every rank of the group must construct it, in the same order relative to other
    communicators of that group.

    Args:
        group: the process group (``None``: the default group; no process group at all: a world of
            size 1 that does nothing).
        capacity_bytes: bytes of one slot (rounded up to 64 B); tensors larger than this are processed in
            pieces. The segment holds 2·(n+1) slots, plus the arenas.
        direct: use the direct path (``process_vm_readv``) where every rank can (decided collectively).
        direct_min_bytes: tensors above this size take the direct path; smaller ones the slots. Given, it
            fixes the path by size; left out (``None``), the path is measured per collective and size
            class (``tune``), and this rule (``DIRECT_MIN_BYTES``; ``OVERSUBSCRIBED_DIRECT_MIN_BYTES``
            with more ranks than cores) only serves the one call before the choice is known.
        direct_block_bytes: bytes of the peers' blocks together in the direct reduction's private buffer
            (each peer's block is 1/(n−1) of it).
        timeout_s: how long a rank waits for a peer before raising (default: the group's timeout).
        arena_bytes: bytes of this rank's arena for :meth:`allocate` (0: none).
        small_bytes: all_reduce pieces up to this size take the one-barrier path (0: never).
        futex: block waiters in ``futex(2)`` (Linux), woken by the publisher; ``False``: sleep-polling.
        tune: choose between the slots and the direct path by timing both on the first calls of each
            collective and power-of-two size class (:mod:`._shm_tune`). Default: on unless
            ``direct_min_bytes`` is given.
        store: a c10d store for the creation handshake (default: the process group's own store).
        shm_dir: where segments are created (a tmpfs; Linux's ``/dev/shm``).
    """

    # -- the collectives (group ranks inside; src/dst are global ranks, as in torch) -----------------

    @torch.no_grad()
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """Reduce ``tensor`` over the group into ``tensor`` on every rank (in place; returned)."""
        name, factor = split_premul(op)
        if factor is not None:
            premultiply(tensor, factor, "shm all_reduce", out=tensor)  # in place: the result replaces it
        return self._reduce(tensor, name, None, "all_reduce")

    @torch.no_grad()
    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: Any = "sum") -> torch.Tensor:
        """Reduce into ``tensor`` on global rank ``dst`` (in place); the others' tensors are unchanged."""
        root = self.peers.group_rank(dst, "dst")
        name, factor = split_premul(op)
        if factor is None:
            return self._reduce(tensor, name, root, "reduce")
        scaled = self._reduce(premultiply(tensor, factor, "shm reduce"), name, root, "reduce")
        return tensor.copy_(scaled) if root == self.rank else tensor

    def _reduce(self, tensor: torch.Tensor, op: str, root: int | None, function: str) -> torch.Tensor:
        check_op(f"shm {function}", op, tensor.dtype)
        if self.size == 1 or tensor.numel() == 0:
            return tensor
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        with self._call(function), self._route(function, buf, root is None) as direct:
            if direct:
                self._all_reduce_direct(buf.view(-1), op)
            else:
                self._reduce_flat(buf.view(-1), op, root)
        if buf is not tensor and (root is None or root == self.rank):
            tensor.copy_(buf)
        return tensor

    def _reduce_flat(self, flat: torch.Tensor, op: str, root: int | None) -> None:
        """all_reduce (``root=None``) or reduce of the contiguous ``flat``, piece by piece (steps 1-4 of
        the module docstring; a small piece: 1, 2, then every rank reduces it whole)."""
        n, r, dtype = self.size, self.rank, flat.dtype
        es, numel = _esize(dtype), flat.numel()
        per = self.capacity_bytes // es
        pieces = [(lo, min(numel, lo + per)) for lo in range(0, numel, per)]
        function = "all_reduce" if root is None else "reduce"
        sig = _signature(function, op, dtype, numel, -1 if root is None else root, 0, len(pieces))
        grain = max(1, _ALIGN // es)
        for p, (lo, hi) in enumerate(pieces):
            what = (function, p, len(pieces))
            k, b = self._next()
            m = hi - lo
            self._flat(dtype, self._slot(b, r), m).copy_(flat[lo:hi])  # 1. my piece into my slot
            self._publish(_ARRIVE, k, _with_seq(sig, k) if p == 0 else None)
            self._wait(_ARRIVE, k, what)  # 2. every rank's piece is in its slot
            if p == 0:
                self._check_sig(k, _with_seq(sig, k))
            if m * es <= self.small_bytes:  # every rank reduces the whole piece: no second barrier
                if root is None or root == r:
                    out = flat[lo:hi]
                    _reduce_rows(self._slots(dtype, b, 0, m), out, op)
                    if op == "mean":
                        divide_(out, n)
                continue
            q = -(-m // n // grain) * grain if m >= n * grain else grain
            a, c = min(m, r * q), min(m, (r + 1) * q)
            res = self._flat(dtype, self._res_off + b * self.capacity_bytes, m)
            if c > a:  # 3. my chunk of the piece, from every slot, into the result buffer
                _reduce_rows(self._slots(dtype, b, a, c - a), res[a:c], op)
                if op == "mean":
                    divide_(res[a:c], n)
            self._publish(_REDUCED, k)
            if root is None or root == r:
                self._wait(_REDUCED, k, what)  # 4. every chunk is reduced: copy the piece out
                flat[lo:hi].copy_(res)

    @torch.no_grad()
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """torch's ``reduce_scatter_tensor``: ``inp`` is n equal chunks (flat order); ``out`` receives
        the reduction of chunk ``rank``. Returns ``out``."""
        op = normalize_op(op)
        check_op("shm reduce_scatter", op, inp.dtype)
        n = self.size
        if out.dtype != inp.dtype or inp.numel() != n * out.numel():
            raise ValueError(
                f"shm reduce_scatter: input must have group size ({n}) × output's elements and the same "
                f"dtype; got input {tuple(inp.shape)} {inp.dtype}, output {tuple(out.shape)} {out.dtype}."
            )
        k = out.numel()
        self.reduce_scatter_flat(inp, [(c * k, (c + 1) * k) for c in range(n)], op, out)
        return out

    @torch.no_grad()
    def reduce_scatter_flat(
        self, inp: torch.Tensor, bounds: Sequence[tuple[int, int]], op: Any, out: torch.Tensor
    ) -> torch.Tensor:
        """Reduce the flat ``inp`` over the group; ``out`` (``bounds[rank]``'s length) receives elements
        ``bounds[rank]`` of the result. ``bounds``: one ``[start, end)`` per rank, the same on every rank."""
        op, factor = split_premul(op)
        if factor is not None:  # the input is the caller's: scale a copy
            inp = premultiply(inp, factor, "shm reduce_scatter")
        check_op("shm reduce_scatter", op, inp.dtype)
        lo, hi = bounds[self.rank]
        if out.numel() != hi - lo:
            raise ValueError(f"shm reduce_scatter: output has {out.numel()} elements, bounds say {hi - lo}.")
        if self.size == 1:
            out.copy_(inp.reshape(-1)[lo:hi].view(out.shape))
            return out
        src = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
        dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        cpu = src.device.type == "cpu" and dst.device.type == "cpu"
        moves = any(b > a for a, b in bounds)
        with self._call("reduce_scatter"), self._route("reduce_scatter", src, moves, cpu) as direct:
            if direct:
                self._reduce_scatter_direct(src, list(bounds), op, dst.view(-1))
            else:
                self._reduce_scatter(src, list(bounds), op, dst.view(-1))
        if dst is not out:
            out.copy_(dst)
        return out

    def _reduce_scatter(
        self, flat: torch.Tensor, bounds: list[tuple[int, int]], op: str, out: torch.Tensor
    ) -> None:
        n, r, dtype = self.size, self.rank, flat.dtype
        es = _esize(dtype)
        lens = [b - a for a, b in bounds]
        q = self.capacity_bytes // es // n  # a rank's slot holds one sub-piece of every chunk
        npieces = -(-max(lens) // q) if max(lens) else 0
        even = len(set(lens)) == 1 and all(a == c * lens[0] for c, (a, _) in enumerate(bounds))
        sig = _signature("reduce_scatter", op, dtype, flat.numel(), -1, _bounds_hash(lens), npieces)
        for p in range(npieces):
            what = ("reduce_scatter", p, npieces)
            k, b = self._next()
            s = p * q
            mine = self._rows(dtype, self._slot(b, r), q * es, n, q)  # (n, q): sub-slot c for chunk c
            if even:
                e = min(lens[0], s + q)
                mine[:, : e - s].copy_(flat.view(n, lens[0])[:, s:e])
            else:
                for c, (a, _) in enumerate(bounds):
                    e = min(lens[c], s + q)
                    if e > s:
                        mine[c, : e - s].copy_(flat[a + s : a + e])
            self._publish(_ARRIVE, k, _with_seq(sig, k) if p == 0 else None)
            self._wait(_ARRIVE, k, what)
            if p == 0:
                self._check_sig(k, _with_seq(sig, k))
            e = min(lens[r], s + q)
            if e > s:
                _reduce_rows(self._slots(dtype, b, r * q, e - s), out[s:e], op)
                if op == "mean":
                    divide_(out[s:e], n)

    @torch.no_grad()
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        """torch's ``all_gather_into_tensor``: ``out`` (n × ``inp``'s elements, flat order) receives every
        rank's ``inp`` in group-rank order. Returns ``out``."""
        n, k = self.size, inp.numel()
        if out.dtype != inp.dtype or out.numel() != n * k:
            raise ValueError(
                f"shm all_gather: output must have group size ({n}) × input's elements and the same dtype; "
                f"got input {tuple(inp.shape)} {inp.dtype}, output {tuple(out.shape)} {out.dtype}."
            )
        return self.all_gather_flat(inp, [(c * k, (c + 1) * k) for c in range(n)], out)

    @torch.no_grad()
    def all_gather_flat(
        self, inp: torch.Tensor, bounds: Sequence[tuple[int, int]], out: torch.Tensor
    ) -> torch.Tensor:
        """Every rank's flat ``inp`` lands in elements ``bounds[rank]`` of the flat ``out`` (the chunks may
        differ in length; ``bounds`` is the same on every rank)."""
        lo, hi = bounds[self.rank]
        if inp.numel() != hi - lo:
            raise ValueError(f"shm all_gather: input has {inp.numel()} elements, bounds say {hi - lo}.")
        dst = out if out.is_contiguous() else torch.empty_like(out, memory_format=torch.contiguous_format)
        if self.size == 1:
            dst.view(-1)[lo:hi].copy_(inp.reshape(-1))
        else:
            src = inp.reshape(-1) if inp.is_contiguous() else inp.contiguous().view(-1)
            cpu = src.device.type == "cpu" and dst.device.type == "cpu"
            moves = any(b > a for a, b in bounds)
            with self._call("all_gather"), self._route("all_gather", dst, moves, cpu) as direct:
                if direct:
                    self._all_gather_direct(src, list(bounds), dst.view(-1))
                else:
                    self._all_gather(src, list(bounds), dst.view(-1))
        if dst is not out:
            out.copy_(dst)
        return out

    def _all_gather(self, mine: torch.Tensor, bounds: list[tuple[int, int]], out: torch.Tensor) -> None:
        n, r, dtype = self.size, self.rank, mine.dtype
        es = _esize(dtype)
        lens = [b - a for a, b in bounds]
        per = self.capacity_bytes // es
        npieces = -(-max(lens) // per) if max(lens) else 0
        even = len(set(lens)) == 1 and all(a == c * lens[0] for c, (a, _) in enumerate(bounds))
        sig = _signature("all_gather", "", dtype, out.numel(), -1, _bounds_hash(lens), npieces)
        for p in range(npieces):
            what = ("all_gather", p, npieces)
            k, b = self._next()
            s = p * per
            e = min(lens[r], s + per)
            if e > s:
                self._flat(dtype, self._slot(b, r), e - s).copy_(mine[s:e])
            self._publish(_ARRIVE, k, _with_seq(sig, k) if p == 0 else None)
            self._wait(_ARRIVE, k, what)
            if p == 0:
                self._check_sig(k, _with_seq(sig, k))
            if even:
                e = min(lens[0], s + per)
                out.view(n, lens[0])[:, s:e].copy_(self._slots(dtype, b, 0, e - s))
            else:
                for c, (a, _) in enumerate(bounds):
                    e = min(lens[c], s + per)
                    if e > s:
                        out[a + s : a + e].copy_(self._flat(dtype, self._slot(b, c), e - s))

    @torch.no_grad()
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Copy global rank ``src``'s ``tensor`` into ``tensor`` on every rank (in place; returned)."""
        root = self.peers.group_rank(src, "src")
        if self.size == 1 or tensor.numel() == 0:
            return tensor
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat, dtype, r = buf.view(-1), buf.dtype, self.rank
        per = self.capacity_bytes // _esize(dtype)
        with self._call("broadcast"), self._route("broadcast", flat) as direct:
            if direct:
                self._broadcast_direct(flat, root)
            numel = flat.numel()
            pieces = [] if direct else [(lo, min(numel, lo + per)) for lo in range(0, numel, per)]
            sig = _signature("broadcast", "", dtype, flat.numel(), root, 0, len(pieces))
            for p, (lo, hi) in enumerate(pieces):  # through the root's slot, piece by piece
                what = ("broadcast", p, len(pieces))
                k, b = self._next()
                slot = self._flat(dtype, self._slot(b, root), hi - lo)
                if r == root:
                    slot.copy_(flat[lo:hi])
                self._publish(_ARRIVE, k, _with_seq(sig, k) if p == 0 else None)
                self._wait(_ARRIVE, k, what)
                if p == 0:
                    self._check_sig(k, _with_seq(sig, k))
                if r != root:
                    flat[lo:hi].copy_(slot)
        if buf is not tensor:
            tensor.copy_(buf)
        return tensor

    # -- the direct path (cross-memory attach) ---------------------------------------------------------

    @contextmanager
    def _route(
        self, function: str, t: torch.Tensor, eligible: bool = True, on_cpu: bool | None = None
    ) -> Iterator[bool]:
        """Yield whether this call takes the direct path (inside :meth:`_call`). ``t``: the tensor whose
        size every rank agrees on; ``eligible``: the call has a direct path and moves bytes; ``on_cpu``:
        every tensor of the call on this rank is on the CPU (default: ``t``'s). With tuning
        (:mod:`._shm_tune`) a call of a class still being counted is counted once it has succeeded, a
        trial is timed, and a trial on the slots ends with a DONE barrier, as the direct path does, so
        that both measure the group. A rank with a tensor off the CPU takes the slots; if its peers took
        the direct path, the call signature (root -2 there) raises the same error on every rank."""
        nbytes = t.numel() * _esize(t.dtype)
        cpu = t.device.type == "cpu" if on_cpu is None else on_cpu
        if not (eligible and self.direct):
            yield False
        elif self._tuner is None:
            yield cpu and nbytes > self.direct_min_bytes
        else:
            tuner = self._tuner
            direct, ticket = tuner.pick(function, nbytes)
            take = direct and cpu
            start = tuner.clock() if ticket is not None and tuner.is_trial(ticket) and cpu else None
            yield take
            if ticket is not None:
                if tuner.is_trial(ticket) and not take:
                    what = (function, 0, 1)
                    self._publish(_DONE, self._seq)
                    self._wait(_DONE, self._seq, what)
                tuner.done(ticket, take, None if start is None else tuner.clock() - start)

    def path(self, function: str, nbytes: int) -> str:
        """The path a CPU call of ``function`` (``all_reduce``, ``reduce_scatter``, ``all_gather``,
        ``broadcast``; ``reduce`` always takes the slots) on a tensor of ``nbytes`` takes now: ``"direct"``,
        ``"slots"``, or ``"tuning"`` while its size class is still being measured (all_gather: the
        output's bytes; reduce_scatter: the input's)."""
        if function == "reduce":
            return "slots"
        if function not in TUNED_FUNCTIONS:
            raise ValueError(
                f"shm path: {function!r} is not a collective of shm ({', '.join(TUNED_FUNCTIONS)}, reduce)"
            )
        if not self.direct or self.size == 1:
            return "slots"
        if self._tuner is None:
            return "direct" if nbytes > self.direct_min_bytes else "slots"
        return self._tuner.path(function, nbytes) or "tuning"

    def tuned_paths(self) -> dict[str, dict[int, str]]:
        """The path each collective takes per size class, as measured so far (:mod:`._shm_tune`):
        ``{"all_reduce": {1048576: "slots", ...}}``, keyed by the smallest size of the class in bytes.
        Empty without tuning (``tune=False``, an explicit ``direct_min_bytes``, or no direct path)."""
        return self._tuner.decisions() if self._tuner is not None else {}

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

    @torch.no_grad()
    def all_reduce_inplace_slot(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        """All-reduce a tensor from :meth:`allocate` where it lies: no copy in, peers read it directly.

        Steps (k = this call's step): ``ARRIVE = k``, wait for every ARRIVE (the signature includes the
        arena offset); reduce chunk ``rank`` of every rank's copy into this rank's copy, in place (no peer
        reads that chunk before REDUCED); ``REDUCED = k``,
        wait for every REDUCED; copy the other chunks from their owners' copies; ``DONE = k``, wait for
        every DONE (after that no peer reads this rank's arena, so the caller may write it again).
        """
        op, factor = split_premul(op)
        if factor is not None:
            premultiply(tensor, factor, "shm all_reduce_inplace_slot", out=tensor)
        check_op("shm all_reduce_inplace_slot", op, tensor.dtype)
        if self.size == 1 or tensor.numel() == 0:
            return tensor
        dtype, es, n, r = tensor.dtype, tensor.element_size(), self.size, self.rank
        base = self._u8.data_ptr() + self._arena(r)
        off = tensor.data_ptr() - base
        if not tensor.is_contiguous() or not 0 <= off <= self.arena_bytes - tensor.numel() * es:
            raise ValueError(
                "shm all_reduce_inplace_slot: the tensor must be a contiguous tensor from this "
                "communicator's allocate() (use all_reduce for other tensors)."
            )
        numel = tensor.numel()
        sig = _signature("all_reduce_inplace_slot", op, dtype, numel, -1, off, 1)
        grain = max(1, _ALIGN // es)
        q = -(-numel // n // grain) * grain if numel >= n * grain else grain
        bounds = [(min(numel, j * q), min(numel, (j + 1) * q)) for j in range(n)]
        with self._call("all_reduce_inplace_slot"):
            what = ("all_reduce_inplace_slot", 0, 1)
            k, _ = self._next()
            self._publish(_ARRIVE, k, _with_seq(sig, k))
            self._wait(_ARRIVE, k, what)
            self._check_sig(k, _with_seq(sig, k))
            a, c = bounds[r]
            if c > a:  # the peers read my chunk only after REDUCED: reduce it where it lies
                self._reduce_arena_chunk(tensor.view(-1), off, a, c, op)
            self._publish(_REDUCED, k)
            self._wait(_REDUCED, k, what)
            flat = tensor.view(-1)
            for j, (a, c) in enumerate(bounds):
                if j != r and c > a:
                    flat[a:c].copy_(self._flat(dtype, self._arena(j) + off + a * es, c - a))
            self._publish(_DONE, k)
            self._wait(_DONE, k, what)
        return tensor

    def _reduce_arena_chunk(self, flat: torch.Tensor, off: int, a: int, c: int, op: str) -> None:
        """Elements [a, c) of this rank's arena tensor ``flat`` (at arena offset ``off``) become their
        reduction over every rank's copy, in place, in rank order (``((x0 + x1) + x2) + ...``, as
        :func:`._shm_ops._reduce_rows` does), block by block. With a pairwise op the last combination
        writes straight into ``flat`` (earlier partial results of 3+ ranks go through an L2-sized private
        block); the others reduce into the block and copy it back."""
        dtype, es, n = flat.dtype, _esize(flat.dtype), self.size
        binary = pairwise(op, dtype)
        block = max(1, IN_PLACE_BLOCK_BYTES // es)
        partial = self._scratch_rows(dtype, min(block, c - a))[0] if binary is None or n > 2 else None
        for s in range(a, c, block):
            e = min(c, s + block)
            rows = self._rows(dtype, self._arena(0) + off + s * es, self.arena_bytes, n, e - s)
            own = flat[s:e]
            if binary is None:
                assert partial is not None
                _reduce_rows(rows, partial[: e - s], op)
                own.copy_(partial[: e - s])
            elif n == 2:
                binary(rows[0], rows[1], out=own)  # own is rows[r]: an elementwise op may write its input
            else:
                assert partial is not None
                acc = partial[: e - s]
                binary(rows[0], rows[1], out=acc)
                for j in range(2, n - 1):
                    binary(acc, rows[j], out=acc)
                binary(acc, rows[n - 1], out=own)  # rows[r] was read above (or is rows[n-1] itself)
            if op == "mean":
                divide_(own, n)


# ---------------------------------------------------------------------------------------------------
# module level: comm's conventions, one cached communicator per group


_CACHE: dict[int, tuple[Any, ShmCommunicator]] = {}
"""id(process group) → (the group, its communicator). The group is held so that its id stays unique."""


def get_communicator(group: Any = None, **kwargs: Any) -> ShmCommunicator:
    """The cached communicator of ``group`` (created on first use: collective, every rank must call).

    ``kwargs`` (``capacity_bytes``, ``timeout_s``, ``arena_bytes``...) apply when it is created. Entries
    of destroyed process groups are dropped. Strategies that want their own settings (an arena for
    zero-copy buckets) construct a :class:`ShmCommunicator` themselves instead.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return ShmCommunicator(group, **kwargs)
    pg = group if group is not None else dist.group.WORLD
    live = dist.distributed_c10d._world.pg_map
    for key, (g, c) in list(_CACHE.items()):
        if g not in live:
            c.close()
            del _CACHE[key]
    entry = _CACHE.get(id(pg))
    if entry is not None and entry[0] is pg and not entry[1].closed:
        return entry[1]
    comm = ShmCommunicator(group, **kwargs)
    _CACHE[id(pg)] = (pg, comm)
    return comm


def close_all() -> None:
    """Close every cached communicator (registered with ``atexit``)."""
    for _, comm in list(_CACHE.values()):
        comm.close()
    _CACHE.clear()


atexit.register(close_all)


@torch.no_grad()
def all_reduce(tensor: torch.Tensor, op: Any = "sum", group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over the group; every rank ends with the result in ``tensor`` (in place)."""
    return get_communicator(group).all_reduce(tensor, op)


@torch.no_grad()
def reduce(tensor: torch.Tensor, dst: int = 0, op: Any = "sum", group: Any = None) -> torch.Tensor:
    """Reduce into ``tensor`` on global rank ``dst`` (in place); the others' tensors are unchanged."""
    return get_communicator(group).reduce(tensor, dst, op)


@torch.no_grad()
def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None) -> torch.Tensor:
    """Copy ``tensor`` of global rank ``src`` into ``tensor`` on every rank of the group (in place)."""
    return get_communicator(group).broadcast(tensor, src)


@torch.no_grad()
def all_gather(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape everywhere), concatenated along dim 0 in group-rank order."""
    if tensor.dim() == 0:
        raise ValueError("all_gather: a 0-d tensor has no dim 0 to concatenate along; reshape it to (1,).")
    comm = get_communicator(group)
    out = torch.empty(
        (comm.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    return comm.all_gather(out, tensor) if out.numel() else out


@torch.no_grad()
def reduce_scatter(tensor: torch.Tensor, op: Any = "sum", group: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` over the group and return ``torch.tensor_split(result, n)[rank]`` along dim 0
    (parts may differ by one row; some are empty when dim 0 is shorter than the group)."""
    if tensor.dim() == 0:
        raise ValueError("reduce_scatter: a 0-d tensor has no dim 0 to split along; reshape it to (1,).")
    comm = get_communicator(group)
    rows = chunk_bounds(tensor.shape[0], comm.size)
    unit = math.prod(tensor.shape[1:])
    out = torch.empty(
        (rows[comm.rank][1] - rows[comm.rank][0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device
    )
    if tensor.numel() == 0:
        name, factor = split_premul(op)
        if factor is not None:
            premultiply(tensor, factor, "shm reduce_scatter")
        check_op("shm reduce_scatter", name, tensor.dtype)
        return out
    return comm.reduce_scatter_flat(tensor, [(a * unit, b * unit) for a, b in rows], op, out)
