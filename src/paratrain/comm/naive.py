"""Naive ("star") collectives: one root talks to every other rank directly.

This is the textbook star (the root talks to every rank), made non-blocking: the root posts all of its ``isend``/``irecv`` at once and
then waits, so no rank blocks in a send while its peer blocks too. Simple, and the best choice for tiny
messages on few ranks, but the root's link carries all the traffic, so time grows linearly in n.

α–β costs (n ranks; α per message, β per byte on a link, γ per byte reduced; the root's link serialises
its messages). S is the message size; for all_gather / gather / scatter S is the whole gathered array and
for reduce_scatter it is the whole input:

- broadcast:       (n−1)(α + Sβ)
- reduce:          (n−1)(α + Sβ + Sγ)
- all_reduce:      reduce to 0, then broadcast from 0: 2(n−1)α + 2(n−1)Sβ + (n−1)Sγ
- all_gather:      gather to 0, then broadcast the concatenation: 2(n−1)α + (n−1)(1 + 1/n)Sβ
- reduce_scatter:  reduce to 0, then scatter the parts: 2(n−1)α + (n−1)(1 + 1/n)Sβ + (n−1)Sγ
- gather, scatter: (n−1)(α + Sβ/n)

All functions take group ranks (``root``) and contiguous buffers; :mod:`paratrain.comm` validates.
"""

from __future__ import annotations

import torch

from paratrain.comm._common import Peers, wait_all
from paratrain.comm._ops import combine_, finish_mean_


def broadcast(buf: torch.Tensor, root: int, peers: Peers) -> None:
    """Root ``isend``s ``buf`` to every other rank at once and waits; the others ``irecv`` into ``buf``."""
    if peers.rank == root:
        wait_all([peers.isend(buf, r) for r in range(peers.size) if r != root])
    else:
        peers.irecv(buf, root).wait()


def reduce(buf: torch.Tensor, root: int, op: str, peers: Peers) -> None:
    """Everyone sends ``buf`` to the root; the root combines them into ``buf`` in rank order.

    The root pre-allocates n−1 receive buffers and posts every ``irecv`` before waiting on the first, so
    all senders stream concurrently; it reduces each one as soon as it lands. ``buf`` is left untouched
    on the other ranks.
    """
    if peers.rank != root:
        peers.isend(buf, root).wait()
        return
    others = [r for r in range(peers.size) if r != root]
    bufs = [torch.empty_like(buf) for _ in others]
    works = [peers.irecv(b, r) for b, r in zip(bufs, others, strict=True)]
    for work, incoming in zip(works, bufs, strict=True):
        work.wait()
        combine_(buf, incoming, op)
    finish_mean_(buf, op, peers.size)


def all_reduce(buf: torch.Tensor, op: str, peers: Peers) -> None:
    """Reduce to group rank 0 (which also divides for ``mean``), then broadcast from it."""
    reduce(buf, 0, op, peers)
    broadcast(buf, 0, peers)


def gather_into(buf: torch.Tensor, parts: list[torch.Tensor], root: int, peers: Peers) -> None:
    """Root receives rank r's ``buf`` straight into ``parts[r]`` (all ``irecv`` posted at once)."""
    if peers.rank != root:
        peers.isend(buf, root).wait()
        return
    works = [peers.irecv(parts[r], r) for r in range(peers.size) if r != root]
    parts[root].copy_(buf)
    wait_all(works)


def scatter_from(parts: list[torch.Tensor], out: torch.Tensor, root: int, peers: Peers) -> None:
    """Root ``isend``s ``parts[r]`` to rank r (all at once); rank r ``irecv``s it into ``out``."""
    if peers.rank != root:
        if out.numel() > 0:
            peers.irecv(out, root).wait()
        return
    works = [peers.isend(parts[r], r) for r in range(peers.size) if r != root and parts[r].numel() > 0]
    out.copy_(parts[root])
    wait_all(works)


def all_gather(buf: torch.Tensor, out: torch.Tensor, bounds: list[tuple[int, int]], peers: Peers) -> None:
    """Gather every rank's flat ``buf`` into its range of the flat ``out`` on rank 0, then broadcast."""
    gather_into(buf, [out[a:b] for a, b in bounds], 0, peers)
    broadcast(out, 0, peers)


def reduce_scatter(work: torch.Tensor, bounds: list[tuple[int, int]], op: str, peers: Peers) -> torch.Tensor:
    """Reduce the flat ``work`` (a scratch copy) to rank 0, then scatter the ranges ``bounds`` back.

    Returns this rank's reduced range as a new flat tensor.
    """
    reduce(work, 0, op, peers)
    lo, hi = bounds[peers.rank]
    out = torch.empty(hi - lo, dtype=work.dtype, device=work.device)
    scatter_from([work[a:b] for a, b in bounds], out, 0, peers)
    return out
