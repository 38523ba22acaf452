"""Bandwidth-optimal ring collectives, pipelined: reduce-scatter, all-gather, and all-reduce = both.

The flat tensor is split into n chunks (``torch.tensor_split`` boundaries, so any length works, even one
shorter than n). Rank r sends only to ``right = r+1`` and receives only from ``left = r−1`` (mod n).
The whole all-reduce is one loop of 2(n−1) steps with the same indexing in both phases; at step t:

    send chunk (r − t − 1) mod n to the right,   receive chunk (r − t − 2) mod n from the left.

- Steps 0..n−2 (reduce-scatter): the received chunk is combined into the local one. After step n−2
  chunk r holds the full reduction (divided by n here, once, for ``mean``).
- Steps n−1..2n−3 (all-gather): the received chunk is final and is written straight into place.

Each rank sends 2(n−1) chunks of S/n bytes, i.e. 2(n−1)/n · S: the bandwidth-optimal amount (Patarasuk
& Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009). A naive ring
that passes the whole tensor around sends n−1 full copies instead.

**Pipelining.** Each chunk is cut into P pieces of about ``piece_bytes``. The chunk sent at step t is
the one reduced at step t−1, so the loop does not wait for a whole chunk: as soon as piece j of step
t−1 has landed and been reduced, piece j of step t is sent on. Reducing piece j overlaps the transfer
of pieces j+1.. (Gloo moves bytes on its own threads; NCCL on its own stream), and the first bytes of a
chunk travel on before its last bytes arrived. Reduce-scatter receives land in a small window of
piece-sized scratch slots reused round-robin (``SCRATCH_BYTES``, however large the tensor, so no fresh
pages are faulted in per call); all-gather receives land in place. No other copies. On Gloo receives
are posted ahead of the matching sends (a receive posted late costs Gloo a handshake round trip); on
NCCL each send is grouped with its receive (``batch_isend_irecv``).

**Transport.** On a Gloo group whose ranks share this host, CPU tensors take the ring's own TCP links
(:mod:`._tcp`, :func:`_over_links`): the same loop, one byte stream to the right and one from the left,
without c10d's per-message layer, which cost the c10d version 8-20% more CPU than Gloo's own all-reduce
at 16 MB on 4 ranks. Elsewhere (several hosts, NCCL, CUDA tensors, ``PARATRAIN_RING_LINKS=c10d``) it
runs on c10d's point-to-point as described above.

α–β costs (n ranks, S bytes, P pieces per chunk; α per message, β per byte, γ per byte reduced):

- reduce_scatter (S = whole input):     (n−1)·P·α + (n−1)/n · Sβ + (n−1)/n · Sγ
- all_gather     (S = whole output):    (n−1)·P·α + (n−1)/n · Sβ
- all_reduce:                           2(n−1)·P·α + 2(n−1)/n · Sβ + (n−1)/n · Sγ

(with pipelining the γ term largely hides behind β; the α term grows with P, which is why pieces are
large: P = 1 whenever a chunk is smaller than ``MIN_PIPELINED_BYTES``, and P ≥ 2 above it.)
"""

from __future__ import annotations

import math
from typing import Any

import torch

from paratrain.comm._common import Peers, chunk_bounds, wait_all
from paratrain.comm._ops import combine_, finish_mean_
from paratrain.comm._tcp import RingLinks, links_for
from paratrain.spec.cost import PIECE_BYTES

MIN_PIPELINED_BYTES = 1 << 20
"""A chunk of at least this size is cut into two pieces or more even when it fits in one ``piece_bytes``
piece: with one piece nothing overlaps (each step waits for a whole chunk before it reduces and sends it
on). At 16 MB on 4 ranks (4 MiB chunks) two pieces measured 0.89-1.12x Gloo against one piece's
0.84-1.09x, interleaved in the same runs (``benchmarks/bench_ring.py``)."""
SCRATCH_BYTES = 8 << 20
"""Receive scratch of the reduce-scatter on Gloo (a window of pieces, reused round-robin)."""


def _split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    return [(lo + a, lo + b) for a, b in chunk_bounds(hi - lo, parts)]


def ring(
    flat: torch.Tensor,
    bounds: list[tuple[int, int]],
    op: str,
    peers: Peers,
    reduce_scatter: bool,
    all_gather: bool,
    piece_bytes: int = PIECE_BYTES,
    scratch_bytes: int = SCRATCH_BYTES,
    min_pipelined_bytes: int = MIN_PIPELINED_BYTES,
    *,
    links: bool = True,
) -> None:
    """Run the reduce-scatter steps and/or the all-gather steps of the ring on the flat ``flat`` in place.

    ``bounds[c]`` is chunk c's element range. Reduce-scatter alone leaves the reduction of chunk r on
    rank r; all-gather alone expects chunk r to be valid on rank r and fills in the others. ``links``:
    on a Gloo group whose ranks share this host, move the pieces over the ring's own TCP links
    (:mod:`._tcp`) rather than c10d's point-to-point (every rank must pass the same value).
    """
    n = peers.size
    max_chunk = max(b - a for a, b in bounds)
    if n == 1 or max_chunk == 0:
        if reduce_scatter:
            finish_mean_(flat, op, n)
        return
    npieces = _pieces_per_chunk(max_chunk * flat.element_size(), piece_bytes, min_pipelined_bytes)
    pieces = [_split(a, b, npieces) for a, b in bounds]
    first = 0 if reduce_scatter else n - 1  # steps [first, last)
    last = 2 * (n - 1) if all_gather else n - 1
    if links and not peers.batched and flat.device.type == "cpu":
        tcp = links_for(peers)  # collective the first time on a group
        if tcp is not None:
            _over_links(flat, pieces, op, tcp, first, last, n, peers.rank)
            return
    _C10dRing(flat, pieces, npieces, op, peers, first, last, piece_bytes, scratch_bytes).run()


def _pieces_per_chunk(chunk_bytes: int, piece_bytes: int, min_pipelined_bytes: int) -> int:
    """Pieces of about ``piece_bytes`` per chunk; two at least from ``min_pipelined_bytes`` on."""
    npieces = max(1, math.ceil(chunk_bytes / piece_bytes))
    if npieces == 1 and chunk_bytes >= min_pipelined_bytes:
        npieces = 2  # pipelining depth 2 at least
    return npieces


class _C10dRing:
    """The ring's steps ``[first, last)`` on c10d's point-to-point (Gloo, or NCCL with batched pairs).

    Piece j of step t is sent to the right as soon as piece j of step t−1 has landed from the left (and,
    in the reduce-scatter, been combined in); sends are only waited on at the end, or where the all-gather
    overwrites memory a reduce-scatter send was reading.
    """

    def __init__(
        self,
        flat: torch.Tensor,
        pieces: list[list[tuple[int, int]]],
        npieces: int,
        op: str,
        peers: Peers,
        first: int,
        last: int,
        piece_bytes: int,
        scratch_bytes: int,
    ) -> None:
        self.flat, self.pieces, self.npieces, self.op, self.peers = flat, pieces, npieces, op, peers
        self.n, self.r = n, r = peers.size, peers.rank
        self.right, self.left = (r + 1) % n, (r - 1) % n
        self.first, self.last = first, last
        # Reduce-scatter receives go to a window of ``slots`` piece-sized scratch buffers, used round-robin
        # in landing order (seq = position of (t, j) in the loop). Small and fixed: a few MiB however large
        # the tensor, so no fresh pages are faulted in per call. NCCL posts a receive together with its send,
        # one step ahead of the landing, so it needs two chunks' worth of slots.
        piece_max = max(b - a for chunk in pieces for a, b in chunk)
        slots = (
            2 * npieces if peers.batched else min(2 * npieces, max(2, scratch_bytes // max(1, piece_bytes)))
        )
        self.slots = slots
        reduce_scatter = first < n - 1
        self.scratch = torch.empty(
            slots if reduce_scatter else 0, piece_max, dtype=flat.dtype, device=flat.device
        )
        self.rs_steps = max(0, min(last, n - 1) - first)
        """Reduce-scatter steps this call runs."""
        self.sends: dict[tuple[int, int], list[Any]] = {}
        self.recvs: dict[tuple[int, int], list[Any]] = {}

    def run(self) -> None:
        self._post_first()
        self._loop()
        for works in self.sends.values():
            wait_all(works)

    def _post_first(self) -> None:
        """Gloo: receives are posted ahead of the sends that match them, so that the bytes flow as soon as
        the left neighbour sends (a late receive costs Gloo a notify round trip): the first ``slots``
        reduce-scatter receives now, then one more each time a slot frees up; all-gather receives (into
        place, no slot) one step ahead. Then the first step's sends."""
        n, first, last, npieces = self.n, self.first, self.last, self.npieces
        if not self.peers.batched:
            for seq in range(min(self.slots, self.rs_steps * npieces)):
                self._post_recv(*self._seq_to_step(seq))
            if first + 1 < last and first + 1 >= n - 1:
                for j in range(npieces):
                    self._post_recv(first + 1, j)
            if first >= n - 1:
                for j in range(npieces):
                    self._post_recv(first, j)
        for j in range(npieces):
            self._post_send(first, j)

    def _loop(self) -> None:
        """Wait for piece j of step t−1, reduce it, and immediately send it on as piece j of step t."""
        n, first, last, npieces = self.n, self.first, self.last, self.npieces
        for t in range(first + 1, last + 1):
            for j in range(npieces):
                self._land(t - 1, j)
                if not self.peers.batched:
                    # The reduce-scatter receive that reuses the slot just freed by landing (t−1, j).
                    nxt = (t - 1 - first) * npieces + j + self.slots
                    if nxt < self.rs_steps * npieces:
                        self._post_recv(*self._seq_to_step(nxt))
                    if n - 1 <= t + 1 < last:
                        self._post_recv(t + 1, j)
                if t < last:
                    self._post_send(t, j)

    def _seq_to_step(self, seq: int) -> tuple[int, int]:
        return self.first + seq // self.npieces, seq % self.npieces

    def _slot(self, t: int, j: int, size: int) -> torch.Tensor:
        return self.scratch[((t - self.first) * self.npieces + j) % self.slots, :size]

    def _recv_target(self, t: int, j: int) -> torch.Tensor:
        """Where piece j of step t lands: a scratch slot (reduce-scatter) or its final place (all-gather)."""
        a, b = self.pieces[(self.r - t - 2) % self.n][j]
        if t < self.n - 1:
            return self._slot(t, j, b - a)
        # The all-gather overwrites this piece; during the reduce-scatter (step t−n+1) this rank sent it
        # from the same memory, so that send must have completed (it almost always has).
        wait_all(self.sends.pop((t - self.n + 1, j), []))
        return self.flat[a:b]

    def _post_recv(self, t: int, j: int) -> None:
        target = self._recv_target(t, j)
        self.recvs[(t, j)] = [self.peers.irecv(target, self.left, tag=t)] if target.numel() else []

    def _post_send(self, t: int, j: int) -> None:
        a, b = self.pieces[(self.r - t - 1) % self.n][j]
        piece = self.flat[a:b]
        if self.peers.batched:  # NCCL: the send and the receive of a piece as one group (see _common)
            target = self._recv_target(t, j)
            self.sends[(t, j)], self.recvs[(t, j)] = self.peers.exchange(
                piece, self.right, target, self.left, tag=t
            )
        else:
            self.sends[(t, j)] = [self.peers.isend(piece, self.right, tag=t)] if b > a else []

    def _land(self, t: int, j: int) -> None:
        """Piece j of step t has arrived: reduce it in (reduce-scatter steps); all-gather has nothing to do."""
        wait_all(self.recvs.pop((t, j)))
        if t >= self.n - 1:
            return
        a, b = self.pieces[(self.r - t - 2) % self.n][j]
        combine_(self.flat[a:b], self._slot(t, j, b - a), self.op)
        if t == self.n - 2:  # chunk r is complete: the one place the mean divides
            finish_mean_(self.flat[a:b], self.op, self.n)


def _over_links(
    flat: torch.Tensor,
    pieces: list[list[tuple[int, int]]],
    op: str,
    tcp: RingLinks,
    first: int,
    last: int,
    n: int,
    r: int,
) -> None:
    """The same loop as :func:`ring`, on the ring's own links: one stream each way, messages in loop order.

    Step t sends piece j of chunk (r−t−1) as soon as piece j of step t−1 has landed (and, in the
    reduce-scatter, been combined), so the reduction of one piece overlaps the transfer of the next, as
    on c10d. Sends run on the links' thread; a receive blocks this thread in the kernel, GIL released,
    until the whole piece is there. Reduce-scatter pieces land in one piece-sized scratch (a receive is
    complete before the next starts), all-gather pieces in place.
    """
    what = (
        "all_reduce"
        if first == 0 and last == 2 * (n - 1)
        else "reduce_scatter"
        if first == 0
        else "all_gather"
    )
    _compare_layout(tcp, flat, pieces, op, first, last, what)
    piece_max = max(b - a for chunk in pieces for a, b in chunk)
    scratch = torch.empty(piece_max if first < n - 1 else 0, dtype=flat.dtype)
    sent: dict[tuple[int, int], int] = {}  # (step, piece) -> the links' send number

    def send(t: int, j: int) -> None:
        a, b = pieces[(r - t - 1) % n][j]
        if b > a:
            sent[(t, j)] = tcp.send(flat[a:b], what)

    for j in range(len(pieces[0])):
        send(first, j)
    for t in range(first + 1, last + 1):
        s = t - 1  # the step whose piece j lands now
        for j in range(len(pieces[0])):
            a, b = pieces[(r - s - 2) % n][j]
            if b > a and s < n - 1:
                got = scratch[: b - a]
                tcp.recv(got, what)
                combine_(flat[a:b], got, op)
            elif b > a:
                # The all-gather overwrites memory this rank sent from at step s−n+1: that send must be
                # in the kernel's hands first (it almost always is).
                if (s - n + 1, j) in sent:
                    tcp.wait_sent(sent[(s - n + 1, j)])
                tcp.recv(flat[a:b], what)
            if s == n - 2:  # chunk r is complete: the one place the mean divides
                finish_mean_(flat[a:b], op, n)
            if t < last:
                send(t, j)
    tcp.flush()  # the caller may write to ``flat`` once this returns


_LAYOUT_WORDS = 6


def _layout(
    flat: torch.Tensor, pieces: list[list[tuple[int, int]]], op: str, first: int, last: int
) -> list[int]:
    from paratrain.comm._check import dtype_code
    from paratrain.comm._ops import OPS

    return [first, last, OPS.index(op), dtype_code(flat.dtype), flat.numel(), len(pieces[0])]


def _compare_layout(
    tcp: RingLinks,
    flat: torch.Tensor,
    pieces: list[list[tuple[int, int]]],
    op: str,
    first: int,
    last: int,
    what: str,
) -> None:
    """The first message of every call over the links: this rank's layout (steps, op, dtype, elements,
    pieces) to the right, the left neighbour's compared with it. The streams carry no headers otherwise,
    so a neighbour making another call would misalign them; this catches it before any data moves, at
    the cost of one 48-byte message sent ahead of the first piece (no extra round trip). On a mismatch
    the links are closed, so the rest of the ring fails at once too."""
    mine = torch.tensor(_layout(flat, pieces, op, first, last), dtype=torch.int64)
    theirs = torch.empty(_LAYOUT_WORDS, dtype=torch.int64)
    seq = tcp.send(mine, what)
    tcp.recv(theirs, what)
    tcp.wait_sent(seq)  # in the kernel's hands: ``mine`` is a local, and the right must get it before a close
    if torch.equal(mine, theirs):
        return
    a, b = mine.tolist(), theirs.tolist()
    tcp.close()

    def show(v: list[int]) -> str:
        from paratrain.comm._check import dtype_from_code
        from paratrain.comm._ops import OPS

        step = {(0, 2 * (tcp.peers.size - 1)): "all_reduce", (0, tcp.peers.size - 1): "reduce_scatter"}
        kind = step.get((v[0], v[1]), "all_gather" if v[0] == tcp.peers.size - 1 else f"steps {v[0]}-{v[1]}")
        try:
            dtype: Any = dtype_from_code(v[3])
        except ValueError:
            dtype = "?"
        op_name = OPS[v[2]] if 0 <= v[2] < len(OPS) else "?"
        return f"ring {kind}, op {op_name!r}, {dtype}, {v[4]} elements"

    raise ValueError(
        f"{what}: the ranks of the group disagree on the call (every rank must call the same collective "
        f"with the same algorithm, op, dtype and shape):\n  rank {tcp.peers.global_rank(tcp.peers.rank)}: "
        f"{show(a)}\n  rank {tcp.left}: {show(b)}"
    )


def all_reduce(
    buf: torch.Tensor,
    op: str,
    peers: Peers,
    piece_bytes: int = PIECE_BYTES,
    scratch_bytes: int = SCRATCH_BYTES,
    min_pipelined_bytes: int = MIN_PIPELINED_BYTES,
    *,
    links: bool = True,
) -> None:
    """Ring all-reduce of the contiguous ``buf`` in place: 2(n−1) pipelined steps (``links``: see :func:`ring`)."""
    flat = buf.view(-1)
    bounds = chunk_bounds(flat.numel(), peers.size)
    ring(flat, bounds, op, peers, True, True, piece_bytes, scratch_bytes, min_pipelined_bytes, links=links)


def reduce_scatter(
    work: torch.Tensor,
    bounds: list[tuple[int, int]],
    op: str,
    peers: Peers,
    piece_bytes: int = PIECE_BYTES,
    scratch_bytes: int = SCRATCH_BYTES,
) -> torch.Tensor:
    """Ring reduce-scatter of the flat scratch copy ``work``; returns this rank's reduced range (a copy)."""
    ring(work, bounds, op, peers, True, False, piece_bytes, scratch_bytes)
    lo, hi = bounds[peers.rank]
    return work[lo:hi].clone()


def all_gather(
    out: torch.Tensor, bounds: list[tuple[int, int]], peers: Peers, piece_bytes: int = PIECE_BYTES
) -> None:
    """Ring all-gather into the flat ``out`` whose range ``bounds[rank]`` already holds this rank's data."""
    ring(out, bounds, "sum", peers, False, True, piece_bytes)
