"""Recursive halving / doubling all-reduce (Rabenseifner's algorithm), for any number of ranks.

With p = 2^k ranks the vector is split into p chunks and every rank v ends up owning chunk v:

1. **Reduce-scatter by recursive halving.** For mask = p/2, p/4, .., 1 rank v pairs with ``v ^ mask``.
   Each holds a window of chunks; it sends the half its partner keeps, receives the half it keeps, and
   reduces that in. After k steps the window is the single chunk v, fully reduced.
2. **All-gather by recursive doubling.** For mask = 1, 2, .., p/2 the same pairs swap their windows, which
   double each step, until everyone has everything.

Both partners send at once (``Peers.exchange``: one NCCL group, or two Gloo async ops).

**n not a power of two** (MPICH's approach). Let p be the largest power of two ≤ n and m = n − p. Among
the first 2m ranks, each even rank sends its whole vector to the odd rank above it and sits out; the odd
rank reduces the pair and takes part as virtual rank r // 2. Ranks ≥ 2m take part as r − m. At the end
every odd rank sends the finished vector back to its even partner.

α–β costs (n ranks, S bytes; α per message, β per byte, γ per byte reduced), p = 2^⌊log2 n⌋:

- n = p:    2·log2(p)·α + 2(p−1)/p · Sβ + (p−1)/p · Sγ
- n ≠ p:    the above, plus 2(α + Sβ) + Sγ for the fold-in and the final copy-back

It needs 2·log2 p messages where the ring needs 2(n−1), with the same bandwidth term, so it wins for
medium messages on many ranks; the ring's pipelining wins for large ones.

Reference: Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005), section 4.4; Rabenseifner, "Optimization of Collective Reduction Operations" (ICCS 2004).
"""

from __future__ import annotations

import torch

from paratrain.comm._common import Peers, chunk_bounds, wait_all
from paratrain.comm._ops import combine_, finish_mean_


def all_reduce(buf: torch.Tensor, op: str, peers: Peers) -> None:
    """Rabenseifner all-reduce of the contiguous ``buf`` in place."""
    n, r = peers.size, peers.rank
    flat = buf.view(-1)
    if n == 1 or flat.numel() == 0:
        finish_mean_(flat, op, n)
        return
    p = 1 << (n.bit_length() - 1)
    m = n - p

    # -- fold the extra ranks in: even ranks below 2m hand their vector to the odd rank above them --------
    if r < 2 * m and r % 2 == 0:
        peers.isend(flat, r + 1).wait()
        peers.irecv(flat, r + 1).wait()  # the finished result, sent back at the very end
        return
    if r < 2 * m:
        incoming = torch.empty_like(flat)
        peers.irecv(incoming, r - 1).wait()
        combine_(flat, incoming, op)
        v = r // 2
    else:
        v = r - m

    def real(u: int) -> int:
        """Virtual rank (0..p−1) → group rank."""
        return 2 * u + 1 if u < m else u + m

    chunks = chunk_bounds(flat.numel(), p)

    def span(lo: int, hi: int) -> tuple[int, int]:
        """Chunk window [lo, hi) → element range."""
        return chunks[lo][0], chunks[hi - 1][1]

    # -- reduce-scatter by recursive halving ------------------------------------------------------------
    lo, hi = 0, p
    scratch = torch.empty(span(0, p // 2)[1] - span(0, p // 2)[0], dtype=flat.dtype, device=flat.device)
    mask = p // 2
    while mask >= 1:
        partner = v ^ mask
        mid = (lo + hi) // 2
        if v & mask:  # keep the upper half, give the lower one
            keep_lo, keep_hi, give_lo, give_hi = mid, hi, lo, mid
        else:
            keep_lo, keep_hi, give_lo, give_hi = lo, mid, mid, hi
        ka, kb = span(keep_lo, keep_hi)
        ga, gb = span(give_lo, give_hi)
        incoming = scratch[: kb - ka]
        sends, recvs = peers.exchange(flat[ga:gb], real(partner), incoming, real(partner), tag=mask)
        wait_all(recvs)
        combine_(flat[ka:kb], incoming, op)
        wait_all(sends)  # the next step sends from the window just reduced; this one must be out first
        lo, hi = keep_lo, keep_hi
        mask //= 2
    a, b = chunks[v]
    finish_mean_(flat[a:b], op, n)

    # -- all-gather by recursive doubling: swap windows with the partner, which is adjacent -------------
    mask = 1
    while mask < p:
        partner = v ^ mask
        other_lo, other_hi = (lo - mask, lo) if v & mask else (hi, hi + mask)
        ma, mb = span(lo, hi)
        oa, ob = span(other_lo, other_hi)
        sends, recvs = peers.exchange(flat[ma:mb], real(partner), flat[oa:ob], real(partner), tag=p + mask)
        wait_all(recvs)
        wait_all(sends)
        lo, hi = min(lo, other_lo), max(hi, other_hi)
        mask *= 2

    # -- hand the result back to the ranks that sat out ---------------------------------------------------
    if r < 2 * m:
        peers.isend(flat, r - 1).wait()
