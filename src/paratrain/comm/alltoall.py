"""All-to-all with uneven splits, built from point-to-point send/recv: the pairwise exchange.

Rank ``r`` holds one block of rows for every rank (``input_split_sizes[j]`` rows for rank ``j``, in rank
order along dim 0) and receives one block from every rank (``output_split_sizes[j]`` rows from rank ``j``).
This is ``torch.distributed.all_to_all_single`` with split sizes; expert parallelism sends each token to the
rank that owns its expert with it (:mod:`paratrain.parallel.expert`).

**Pairwise exchange** (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
operations in MPICH", section 3.5): in round ``i = 1 .. n-1`` rank ``r`` sends its block for ``(r + i) mod n``
and receives the block of ``(r - i) mod n``, both posted together, and waits for both before the next
round. Every round is a permutation, so each link carries one message at a time in each direction; the
own block is a local copy. An empty block is neither sent nor received (both sides know its size), so a
rank whose experts received no tokens takes part without a zero-byte message.

α–β cost, with ``S`` the bytes a rank sends in all: ``(n - 1) α + S β`` (each byte crosses one link once),
the same as the backend's linear algorithm, in ``n - 1`` synchronised rounds.

**Split sizes.** ``output_split_sizes=None`` exchanges the counts first (one all-to-all of ``n`` integers),
as a dispatcher does; ``input_split_sizes=None`` splits dim 0 evenly. With ``check=True`` the ranks first
agree on the call (algorithm, dtype, row shape) and, when both split lists are given, that each rank's
``output_split_sizes`` are what its peers send: a mismatch raises the same ``ValueError`` on every rank
instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._check import check_algorithm, check_consistent
from paratrain.comm._common import Peers, chunk_bounds, peers, wait_all


def _offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def pairwise(
    inp: torch.Tensor, out: torch.Tensor, send: Sequence[int], recv: Sequence[int], p: Peers
) -> None:
    """The exchange itself on contiguous tensors: rows ``send[j]`` of ``inp`` to rank ``j``, ``recv[j]`` rows of
    ``out`` from rank ``j`` (group ranks)."""
    si, ro = _offsets(send), _offsets(recv)
    r, n = p.rank, p.size
    out[ro[r] : ro[r + 1]].copy_(inp[si[r] : si[r + 1]])
    for i in range(1, n):
        to, frm = (r + i) % n, (r - i) % n
        sends, recvs = p.exchange(inp[si[to] : si[to + 1]], to, out[ro[frm] : ro[frm + 1]], frm)
        wait_all(sends)
        wait_all(recvs)


def exchange_counts(send: Sequence[int], p: Peers, device: torch.device) -> list[int]:
    """How many rows each rank sends to this one, from what this rank sends to each (a native all-to-all of
    one integer per rank)."""
    mine = torch.tensor(list(send), dtype=torch.int64, device=device)
    theirs = torch.empty_like(mine)
    dist.all_to_all_single(theirs, mine, group=p.group)
    return [int(v) for v in theirs.tolist()]


@torch.no_grad()
def all_to_all(
    tensor: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    algorithm: str = "pairwise",
    group: Any = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Send ``input_split_sizes[j]`` rows of ``tensor`` (dim 0, in rank order) to group rank ``j``; return the
    rows received, ``output_split_sizes[j]`` from rank ``j``, in rank order. ``algorithm``: ``pairwise`` (this
    module) or ``native`` (``torch.distributed.all_to_all_single``)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_to_all: expected a torch.Tensor, got {type(tensor).__name__}.")
    check_algorithm("all_to_all", algorithm)
    if tensor.dim() == 0:
        raise ValueError("all_to_all: a 0-d tensor has no dim 0 to split; reshape it to (1,).")
    p = peers("all_to_all", group)
    n = p.size
    if input_split_sizes is None:
        send = [b - a for a, b in chunk_bounds(tensor.shape[0], n)]
    else:
        send = [int(s) for s in input_split_sizes]
    if len(send) != n or min(send, default=0) < 0 or sum(send) != tensor.shape[0]:
        raise ValueError(
            f"all_to_all: input_split_sizes {send} must be {n} non-negative row counts summing to the "
            f"tensor's {tensor.shape[0]} rows."
        )
    if output_split_sizes is not None:
        recv = [int(s) for s in output_split_sizes]
        if len(recv) != n or min(recv, default=0) < 0:
            raise ValueError(f"all_to_all: output_split_sizes {recv} must be {n} non-negative row counts.")
    if check:
        # the row shape and dtype must agree; the numbers of rows differ by design
        check_consistent(p, "all_to_all", algorithm, None, -1, tensor.new_empty((0, *tensor.shape[1:])))
    if output_split_sizes is None:
        recv = exchange_counts(send, p, tensor.device) if n > 1 else list(send)
    elif check and n > 1:
        _check_splits(send, recv, p, tensor.device)
    out = tensor.new_empty((sum(recv), *tensor.shape[1:]))
    if n == 1:
        return out.copy_(tensor)
    inp = tensor.contiguous()
    if algorithm == "native":
        dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out
    row = inp[0].numel() if inp.shape[0] else out[0].numel() if out.shape[0] else 0
    pairwise(inp.view(-1), out.view(-1), [s * row for s in send], [s * row for s in recv], p)
    return out


def _check_splits(send: list[int], recv: list[int], p: Peers, device: torch.device) -> None:
    """Every rank learns what its peers send it and compares with its ``output_split_sizes``; one all-gather of
    the verdicts makes every rank raise the same error."""
    theirs = exchange_counts(send, p, device)
    bad = torch.tensor([int(theirs != recv)], dtype=torch.int64, device=device)
    verdicts = torch.empty(p.size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(verdicts, bad, group=p.group)
    wrong = [p.global_rank(r) for r, v in enumerate(verdicts.tolist()) if v]
    if wrong:
        raise ValueError(
            f"all_to_all: output_split_sizes disagree with what the peers send on rank(s) {wrong} (this rank "
            f"expects {recv}, its peers send {theirs}). Pass output_split_sizes=None to exchange the counts."
        )
