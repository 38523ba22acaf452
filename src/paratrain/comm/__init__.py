"""Collectives built from point-to-point ``isend``/``irecv``, checked against the backend's own.

    from paratrain import comm
    comm.all_reduce(grad, op="mean", algorithm="ring")        # in place, every rank
    comm.broadcast(param, src=0, algorithm="tree")            # in place
    parts = comm.all_gather(shard, algorithm="ring")          # new tensor, rank order along dim 0

Algorithms (α–β costs in each module's docstring and in docs/comm.md):

- ``naive`` (:mod:`.naive`): a star through one root; best for tiny messages on few ranks.
- ``tree``  (:mod:`.tree`): binomial tree, ⌈log2 n⌉ rounds; latency-optimal broadcast/reduce.
- ``ring``  (:mod:`.ring`): chunked, pipelined reduce-scatter + all-gather; bandwidth-optimal. On a
  Gloo group on one host its pieces travel over TCP links of its own (:mod:`._tcp`), not c10d's p2p.
- ``rhd``   (:mod:`.rhd`): Rabenseifner's recursive halving/doubling, any n.
- ``shm``   (:mod:`.shm`): one shared-memory segment per group, no sockets; the ranks of one host only.
- ``pairwise`` (:mod:`.alltoall`): all-to-all with uneven splits, n−1 rounds of paired send/recv.
- ``native``: the backend's own collective (Gloo, NCCL), so callers can switch between the two.

Conventions, shared by every function:

- ``group=None`` is the default group. Ranks *inside* the algorithms are group ranks; ``src``/``dst``
  are **global** ranks, exactly as in ``torch.distributed``.
- Without a process group (a plain script) every function is the world-of-size-1 result.
- ``op`` is one of ``sum mean max min prod``; ``mean`` is sum / group size and needs a float dtype.
- Any shape (0-d tensors included where the function allows it), any length (also shorter than the
  group), float and integer dtypes, CPU or CUDA; non-contiguous tensors are handled by a copy.
- ``check=True`` first verifies that every rank makes the same call (collective, algorithm, op, root,
  dtype, shape) with one tiny native all-gather, and raises the same ``ValueError`` on every rank
  instead of deadlocking. Hot loops whose shapes cannot disagree may pass ``check=False``.
- Everything runs under ``torch.no_grad()``; in-place results are written into the caller's tensor,
  which is also returned.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm import naive, rhd, ring, shm, tree
from paratrain.comm._check import ALGORITHMS, check_algorithm, check_consistent
from paratrain.comm._common import Peers, chunk_bounds, contiguous_buffer, peers
from paratrain.comm._ops import OPS, check_op, finish_mean_, native_op
from paratrain.comm._scatter import scatter
from paratrain.comm.alltoall import all_to_all

__all__ = [
    "ALGORITHMS",
    "OPS",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]


def _prepare(function: str, tensor: torch.Tensor, algorithm: str, op: str | None, group: Any) -> Peers:
    """Local validation (before any communication, so a bad call fails the same way on every rank)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{function}: expected a torch.Tensor, got {type(tensor).__name__}.")
    check_algorithm(function, algorithm)
    if op is not None:
        check_op(function, op, tensor.dtype)
    return peers(function, group)


def _write_back(tensor: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor


@torch.no_grad()
def broadcast(
    tensor: torch.Tensor, src: int = 0, algorithm: str = "tree", group: Any = None, *, check: bool = True
) -> torch.Tensor:
    """Copy ``tensor`` of global rank ``src`` into ``tensor`` on every rank of the group (in place)."""
    p = _prepare("broadcast", tensor, algorithm, None, group)
    root = p.group_rank(src, "src")
    if check:
        check_consistent(p, "broadcast", algorithm, None, root, tensor)
    if p.size == 1 or tensor.numel() == 0:
        return tensor
    buf = contiguous_buffer(tensor)
    if algorithm == "native":
        dist.broadcast(buf, src=src, group=group)
    elif algorithm == "naive":
        naive.broadcast(buf, root, p)
    elif algorithm == "shm":
        shm.broadcast(buf, src, group)
    else:
        tree.broadcast(buf, root, p)
    return _write_back(tensor, buf)


@torch.no_grad()
def reduce(
    tensor: torch.Tensor,
    dst: int = 0,
    op: str = "sum",
    algorithm: str = "tree",
    group: Any = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` over the group into ``tensor`` on global rank ``dst`` (in place).

    The result is defined on ``dst`` only. ``naive`` and ``tree`` leave the other ranks' tensors
    unchanged; ``native`` follows the backend (``torch.distributed.reduce`` makes no promise).
    """
    p = _prepare("reduce", tensor, algorithm, op, group)
    root = p.group_rank(dst, "dst")
    if check:
        check_consistent(p, "reduce", algorithm, op, root, tensor)
    if p.size == 1 or tensor.numel() == 0:
        return tensor
    buf = contiguous_buffer(tensor)
    if algorithm == "native":
        dist.reduce(buf, dst=dst, op=native_op(op), group=group)
        if p.rank == root:
            finish_mean_(buf, op, p.size)
    elif algorithm == "naive":
        naive.reduce(buf, root, op, p)
    elif algorithm == "shm":
        shm.reduce(buf, dst, op, group)
    else:
        tree.reduce(buf, root, op, p)
    return _write_back(tensor, buf) if p.rank == root else tensor


@torch.no_grad()
def all_reduce(
    tensor: torch.Tensor, op: str = "sum", algorithm: str = "ring", group: Any = None, *, check: bool = True
) -> torch.Tensor:
    """Reduce ``tensor`` over the group; every rank ends with the result in ``tensor`` (in place)."""
    p = _prepare("all_reduce", tensor, algorithm, op, group)
    if check:
        check_consistent(p, "all_reduce", algorithm, op, -1, tensor)
    if p.size == 1 or tensor.numel() == 0:
        return tensor
    buf = contiguous_buffer(tensor)
    if algorithm == "native":
        dist.all_reduce(buf, op=native_op(op), group=group)
        finish_mean_(buf, op, p.size)
    elif algorithm == "shm":
        shm.all_reduce(buf, op, group)
    else:
        {"naive": naive.all_reduce, "tree": tree.all_reduce, "ring": ring.all_reduce, "rhd": rhd.all_reduce}[
            algorithm
        ](buf, op, p)
    return _write_back(tensor, buf)


@torch.no_grad()
def all_gather(
    tensor: torch.Tensor, algorithm: str = "ring", group: Any = None, *, check: bool = True
) -> torch.Tensor:
    """Every rank's ``tensor`` (same shape on all ranks), concatenated along dim 0 in group-rank order."""
    p = _prepare("all_gather", tensor, algorithm, None, group)
    if tensor.dim() == 0:
        raise ValueError("all_gather: a 0-d tensor has no dim 0 to concatenate along; reshape it to (1,).")
    if check:
        check_consistent(p, "all_gather", algorithm, None, -1, tensor)
    out = torch.empty((p.size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    if out.numel() == 0:
        return out
    if p.size == 1:
        return out.copy_(tensor)
    flat, k = out.view(-1), tensor.numel()
    bounds = [(r * k, (r + 1) * k) for r in range(p.size)]
    mine = contiguous_buffer(tensor).view(-1)
    if algorithm == "native":
        dist.all_gather_single(flat, mine, group=group)
    elif algorithm == "naive":
        naive.all_gather(mine, flat, bounds, p)
    elif algorithm == "shm":
        shm.get_communicator(group).all_gather_flat(mine, bounds, flat)
    else:
        flat[bounds[p.rank][0] : bounds[p.rank][1]].copy_(mine)
        ring.all_gather(flat, bounds, p)
    return out


@torch.no_grad()
def reduce_scatter(
    tensor: torch.Tensor, op: str = "sum", algorithm: str = "ring", group: Any = None, *, check: bool = True
) -> torch.Tensor:
    """Reduce ``tensor`` over the group and return this rank's part of the result.

    The part is ``torch.tensor_split(result, group_size)[group_rank]`` along dim 0, so the parts may
    differ by one row, and some are empty when dim 0 is shorter than the group. ``tensor`` is unchanged.
    """
    p = _prepare("reduce_scatter", tensor, algorithm, op, group)
    if tensor.dim() == 0:
        raise ValueError("reduce_scatter: a 0-d tensor has no dim 0 to split along; reshape it to (1,).")
    if check:
        check_consistent(p, "reduce_scatter", algorithm, op, -1, tensor)
    rows = chunk_bounds(tensor.shape[0], p.size)
    unit = tensor[0].numel() if tensor.shape[0] > 0 else 0
    bounds = [(a * unit, b * unit) for a, b in rows]
    out_shape = (rows[p.rank][1] - rows[p.rank][0], *tensor.shape[1:])
    if tensor.numel() == 0:
        return torch.empty(out_shape, dtype=tensor.dtype, device=tensor.device)
    if algorithm == "shm":  # reads the caller's tensor where it lies: no scratch copy needed
        return shm.reduce_scatter(tensor, op, group)
    # Scratch copy: the algorithms reduce in place and the caller's tensor must stay unchanged.
    work = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    work.view(tensor.shape).copy_(tensor)
    lo, hi = bounds[p.rank]
    if p.size == 1:
        return work.view(out_shape)
    if algorithm == "native":
        out = torch.empty(hi - lo, dtype=tensor.dtype, device=tensor.device)
        if len({b - a for a, b in bounds}) == 1:
            dist.reduce_scatter_single(out, work, op=native_op(op), group=group)
        else:
            dist.reduce_scatter(out, [work[a:b] for a, b in bounds], op=native_op(op), group=group)
        finish_mean_(out, op, p.size)
    elif algorithm == "naive":
        out = naive.reduce_scatter(work, bounds, op, p)
    else:
        out = ring.reduce_scatter(work, bounds, op, p)
    return out.view(out_shape)


@torch.no_grad()
def gather(
    tensor: torch.Tensor, dst: int = 0, algorithm: str = "naive", group: Any = None, *, check: bool = True
) -> list[torch.Tensor] | None:
    """Collect every rank's ``tensor`` (same shape on all ranks) on global rank ``dst``.

    Returns the list, in group-rank order, on ``dst`` (its own entry is a copy) and ``None`` elsewhere.
    """
    p = _prepare("gather", tensor, algorithm, None, group)
    root = p.group_rank(dst, "dst")
    if check:
        check_consistent(p, "gather", algorithm, None, root, tensor)
    buf = contiguous_buffer(tensor)
    parts = [torch.empty_like(buf) for _ in range(p.size)] if p.rank == root else []
    if p.size == 1 or tensor.numel() == 0:
        for part in parts:
            part.copy_(buf)
        return parts or None
    if algorithm == "native":
        dist.gather(buf, gather_list=parts if p.rank == root else None, dst=dst, group=group)
    else:
        naive.gather_into(buf, parts, root, p)
    return parts if p.rank == root else None
