"""The one place a strategy's transport is chosen: shared memory on one host, hierarchical across hosts,
or the backend.

Strategies (``ddp``, ``dp``, ``zero1``/``zero2``) ask this module for what they need and never import a
transport (the package :mod:`.shm`, the ring's :mod:`._tcp` links):

- :func:`ddp_comm_hook`: the DDP comm hook and its state for ``--comm-algorithm shm`` (one segment per group
  on one host; shared memory inside each host and the backend between hosts otherwise);
- :func:`bucket_all_reduce`: the all-reduce of one gradient bucket for paratrain's ``dp``, for any
  ``--comm-algorithm``: the algorithms of :mod:`paratrain.comm` through :func:`paratrain.comm.all_reduce`,
  the hierarchical shared-memory all-reduce across hosts, or the zero-copy path whose arena holds the
  buckets themselves;
- :func:`sharded_communicator`: ZeRO's reduce-scatter / all-gather through shared memory, refused across
  hosts with the fix.

Every function is collective over its group: each rank of the group calls it, in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from paratrain.comm.shm.communicator import DEFAULT_CAPACITY_BYTES, ShmCommunicator
from paratrain.comm.shm.hier import HierarchicalAllReduce, nodes_of
from paratrain.comm.shm.hook import ShmHookState, shm_allreduce_hook
from paratrain.errors import ConfigError

__all__ = ["SHM_ARENA_SHARE", "BucketAllReduce", "ddp_comm_hook", "sharded_communicator"]

SHM_ARENA_SHARE = 0.5
"""The zero-copy ``shm`` path takes at most this share of the free space of ``/dev/shm``."""


class _Buffer(Protocol):
    buffer: torch.Tensor


def ddp_comm_hook(group: Any) -> tuple[Any, Callable[..., Any], str]:
    """``(state, hook, description)`` to register on a DDP model for ``--comm-algorithm shm``."""
    hier = HierarchicalAllReduce.for_group(group)  # several hosts: shm inside each
    if hier is None:
        return ShmHookState.create(group), shm_allreduce_hook, "shared memory, one host"
    return ShmHookState(hier), shm_allreduce_hook, hier.describe()


class BucketAllReduce:
    """Sums gradient buckets over a group with the transport ``algorithm`` chooses (collective to create).

    ``shm`` with ``zero_copy``: the buckets are moved into the communicator's arena (their ``buffer`` is
    replaced), and each all-reduce reads peers' buckets where they lie. Otherwise the bucket is copied through
    the transport. :attr:`description` says which path was taken.
    """

    def __init__(self, group: Any, algorithm: str, buckets: Sequence[_Buffer], zero_copy: bool) -> None:
        self.algorithm = algorithm
        self.group = group
        self.arena: ShmCommunicator | None = None
        self.hierarchical: HierarchicalAllReduce | None = None
        self.description = algorithm
        self._fn: Callable[[torch.Tensor], Any] | None = None
        hier = HierarchicalAllReduce.for_group(group) if algorithm == "shm" else None  # collective
        if hier is not None:
            self.hierarchical = hier
            self.description = hier.describe()
            self._fn = lambda buf: hier.all_reduce(buf, "sum")
        elif algorithm == "shm" and zero_copy:
            self.arena = _zero_copy_arena(buckets, group)
            if self.arena is not None:
                arena = self.arena
                self.description = "shm, zero-copy (buckets in the shared arena)"
                self._fn = lambda buf: arena.all_reduce_inplace_slot(buf, "sum")

    @property
    def custom(self) -> bool:
        """Whether a path of this module runs the all-reduce (else the caller's algorithm does)."""
        return self._fn is not None

    def __call__(self, buf: torch.Tensor) -> Any:
        assert self._fn is not None
        return self._fn(buf)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()  # gradients that still view the arena keep the mapping alive
        if self.hierarchical is not None:
            self.hierarchical.close()


def _zero_copy_arena(buckets: Sequence[_Buffer], group: Any) -> ShmCommunicator | None:
    """A communicator whose arena holds every bucket, with the buckets moved into it (collective), or
    ``None`` when the zero-copy path cannot be used (GPU tensors, or too little room in ``/dev/shm``: every
    rank then takes the copying path, decided together)."""
    if any(b.buffer.device.type != "cpu" for b in buckets):
        return None
    need = sum(-(-b.buffer.numel() * b.buffer.element_size() // 64) * 64 for b in buckets)
    n = dist.get_world_size(group)
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    total = n * need + (2 * n + 2) * DEFAULT_CAPACITY_BYTES
    fits = torch.tensor([1 if total <= SHM_ARENA_SHARE * free else 0])
    dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=group)  # one path for every rank
    if not fits.item():
        return None
    shm = ShmCommunicator(group, arena_bytes=need)
    for b in buckets:
        b.buffer = shm.allocate(tuple(b.buffer.shape), b.buffer.dtype)
        b.buffer.zero_()
    return shm


def sharded_communicator(group: Any, world: int) -> ShmCommunicator:
    """ZeRO's reduce-scatter and all-gather through shared memory (``reduce_scatter(out, in, op)``,
    ``all_gather(out, in)``); refused when the group spans hosts."""
    if len(nodes_of(group)) > 1:
        raise ConfigError(
            f"--comm-algorithm shm: ZeRO's reduce-scatter and all-gather through shared memory reach "
            f"the ranks of one node, and this run's {world} ranks are on several. Use "
            "--comm-algorithm native across nodes (or --strategy ddp/dp, whose shm all-reduce is "
            "hierarchical: shm inside each node, the backend between them)."
        )
    return ShmCommunicator(group)
