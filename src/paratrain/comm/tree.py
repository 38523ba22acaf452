"""Binomial-tree collectives: ⌈log2 n⌉ rounds instead of the star's n−1.

The tree is rooted at ``root``; ranks are renumbered ``v = (rank − root) mod n`` so the root is v=0. The
parent of v is v with its lowest set bit cleared; its children are ``v + m`` for every power of two
``m`` below v's lowest set bit (for the root: below n). For n = 8::

    0 ── 4 ── 6 ── 7        broadcast: round 1  0→4
    │    └─── 5                        round 2  0→2, 4→6
    ├─── 2 ── 3                        round 3  0→1, 2→3, 4→5, 6→7
    └─── 1

α–β costs (n ranks, S bytes; α per message, β per byte, γ per byte reduced). Every round moves the whole
message, so the tree wins on latency (log n instead of n−1 message times) but not on bandwidth:

- broadcast:  ⌈log2 n⌉(α + Sβ)
- reduce:     ⌈log2 n⌉(α + Sβ + Sγ)
- all_reduce: reduce to 0, then broadcast from 0: 2⌈log2 n⌉(α + Sβ) + ⌈log2 n⌉Sγ

Reference: Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH"
(IJHPCA 2005), section 4 (binomial-tree broadcast and reduce).
"""

from __future__ import annotations

import torch

from paratrain.comm._common import Peers, wait_all
from paratrain.comm._ops import combine_, finish_mean_


def binomial_tree(v: int, n: int) -> tuple[int | None, list[int]]:
    """``(parent, children)`` of virtual rank ``v`` (root 0); children are listed largest subtree first."""
    parent = None
    mask = 1
    while mask < n:
        if v & mask:
            parent = v - mask
            break
        mask <<= 1
    children = []
    m = mask >> 1
    while m > 0:
        if v + m < n:
            children.append(v + m)
        m >>= 1
    return parent, children


def broadcast(buf: torch.Tensor, root: int, peers: Peers) -> None:
    """Receive ``buf`` from the parent, then forward it to every child at once.

    Schedule: a rank blocks (``irecv(...).wait()``) until its parent's copy arrives, then posts one
    ``isend`` per child, largest subtree first (that child has the most forwarding left to do), and
    waits for all of them. Children forward in parallel, so the last rank has it after ⌈log2 n⌉ rounds.
    """
    n = peers.size
    parent, children = binomial_tree((peers.rank - root) % n, n)

    def real(v: int) -> int:  # virtual rank → group rank
        return (v + root) % n

    if parent is not None:
        peers.irecv(buf, real(parent)).wait()
    wait_all([peers.isend(buf, real(c)) for c in children])


def reduce(buf: torch.Tensor, root: int, op: str, peers: Peers, clobber: bool = False) -> None:
    """Combine the children's partial results, then send the subtotal to the parent.

    Schedule: every ``irecv`` from the children is posted up front into its own buffer, so all children
    stream concurrently; the rank then waits on them smallest subtree first (those finish first) and
    folds each into its accumulator as it lands, and finally ``isend``s the subtotal to its parent. The
    root ends with the result in ``buf`` (divided by n for ``mean``).

    With ``clobber=False`` the non-root ranks keep ``buf`` unchanged: the accumulator is the first
    child's receive buffer (``recv <op>= buf``; all ops are commutative), so no extra memory is used.
    """
    n = peers.size
    parent, children = binomial_tree((peers.rank - root) % n, n)

    def real(v: int) -> int:
        return (v + root) % n

    bufs = [torch.empty_like(buf) for _ in children]
    works = [peers.irecv(b, real(c)) for b, c in zip(bufs, children, strict=True)]
    acc = buf
    for work, incoming in zip(reversed(works), reversed(bufs), strict=True):
        work.wait()
        if acc is buf and parent is not None and not clobber:
            combine_(incoming, buf, op)
            acc = incoming
        else:
            combine_(acc, incoming, op)
    if parent is None:
        finish_mean_(buf, op, n)
    else:
        peers.isend(acc, real(parent)).wait()


def all_reduce(buf: torch.Tensor, op: str, peers: Peers) -> None:
    """Tree-reduce to group rank 0, then tree-broadcast from it (``buf`` is overwritten everywhere)."""
    reduce(buf, 0, op, peers, clobber=True)
    broadcast(buf, 0, peers)
