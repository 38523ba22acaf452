"""The shared-memory communicator: the slot protocol of every collective and the module-level functions
(the protocol, the segment layout and the paths are described in :mod:`paratrain.comm.shm`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from paratrain.comm.shm.direct import _DirectPath
from paratrain.comm.shm.ops import (
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
from paratrain.comm.shm.segment import (
    _ALIGN,
    _ARRIVE,
    _DONE,
    _REDUCED,
    DEFAULT_CAPACITY_BYTES,
    DIRECT_MIN_BYTES,
    IN_PLACE_BLOCK_BYTES,
    SMALL_BYTES,
    transport_storages,
)
from paratrain.comm.shm.system import SEGMENT_PREFIX
from paratrain.comm.shm.tune import FUNCTIONS as TUNED_FUNCTIONS

__all__ = [
    "DEFAULT_CAPACITY_BYTES",
    "DIRECT_MIN_BYTES",
    "OPS",
    "SEGMENT_PREFIX",
    "SMALL_BYTES",
    "ShmCommunicator",
    "check_op",
    "native_op",
    "normalize_op",
    "transport_storages",
]


class ShmCommunicator(_DirectPath):
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
            collective and power-of-two size class (:mod:`.tune`). Default: on unless
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
        (:mod:`.tune`) a call of a class still being counted is counted once it has succeeded, a
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
        """The path each collective takes per size class, as measured so far (:mod:`.tune`):
        ``{"all_reduce": {1048576: "slots", ...}}``, keyed by the smallest size of the class in bytes.
        Empty without tuning (``tune=False``, an explicit ``direct_min_bytes``, or no direct path)."""
        return self._tuner.decisions() if self._tuner is not None else {}

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
        :func:`.ops._reduce_rows` does), block by block. With a pairwise op the last combination
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
