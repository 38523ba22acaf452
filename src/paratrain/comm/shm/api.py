"""The module-level shared-memory collectives (``paratrain.comm.shm.all_reduce(t)``, ...): one cached
communicator per process group, created on first use, closed at exit."""

from __future__ import annotations

import atexit
import math
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._common import chunk_bounds
from paratrain.comm.shm.communicator import ShmCommunicator
from paratrain.comm.shm.ops import check_op, premultiply, split_premul

__all__ = ["all_gather", "all_reduce", "broadcast", "close_all", "get_communicator", "reduce", "reduce_scatter"]

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
