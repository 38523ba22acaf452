"""One validated topology per run, and the one DeviceMesh built from it (torchtitan's ``ParallelDims``).

A run's ranks are laid out on a grid of named *axes* (a mesh dimension is an "axis"; "dim" is kept for
tensor dimensions)::

    pp x dp_replicate x dp_shard x tp == world_size          (outermost ... innermost)

- ``tp``: tensor parallel. Innermost, so its ranks are consecutive and share a node: it is the chattiest
  axis (collectives inside every layer).
- ``dp_shard``: data-parallel ranks that each hold 1/``dp_shard`` of the parameters, gradients and optimizer
  state (ZeRO, FSDP).
- ``dp_replicate``: data-parallel replicas of that (sharded) model; gradients are all-reduced across it
  (DDP; HSDP's outer axis). It crosses nodes.
- ``pp``: pipeline stages, outermost.

The degrees are checked once, in the launching process (the strategy preset fills in what the flags leave
open, :meth:`paratrain.parallel.strategy.Strategy.topology_for`), with a message that prints every factor.
Each worker builds one :class:`~torch.distributed.device_mesh.DeviceMesh` from it and every strategy uses
sub-meshes of that one mesh (``mesh["tp"]``, ``mesh["dp_replicate", "dp_shard"]``, ...). Nothing here is a
module-level singleton.

Reference: https://pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paratrain.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh axes, outermost first."""


@dataclass(frozen=True)
class Topology:
    """Degrees of every parallel axis; ``pp * dp_replicate * dp_shard * tp`` must equal ``world_size``."""

    world_size: int
    """Total number of ranks."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP; HSDP's outer axis)."""
    dp_shard: int = 1
    """Data-parallel ranks a model is sharded over (ZeRO / FSDP)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""

    def __post_init__(self) -> None:
        for name in ("world_size", *AXES):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"topology: {name} must be a positive integer, got {value!r}.")
        product = self.pp * self.dp_replicate * self.dp_shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"topology: pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x "
                f"tp {self.tp} = {product}, but the world size is {self.world_size}. Choose degrees whose "
                f"product is {self.world_size} (--pp, --dp-replicate, --dp-shard, --tp)."
            )

    @classmethod
    def infer(
        cls, world_size: int, *, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1, pp: int = 1
    ) -> Topology:
        """Fill in the one degree given as ``-1`` so that the product is ``world_size``."""
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
        free = [k for k, v in degrees.items() if v == -1]
        if len(free) > 1:
            raise ConfigError(f"topology: at most one degree may be inferred (-1), got {free}.")
        if free:
            known = math.prod(v for v in degrees.values() if v != -1)
            if known < 1 or world_size % known:
                given = " x ".join(f"{k} {v}" for k, v in degrees.items() if v != -1)
                raise ConfigError(
                    f"topology: {given} = {known} does not divide the world size {world_size}, so "
                    f"{free[0]} cannot be inferred. Choose degrees that divide {world_size}."
                )
            degrees[free[0]] = world_size // known
        return cls(world_size=world_size, **degrees)

    # ---- derived ---------------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Ranks that see different data: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def describe(self) -> str:
        return " x ".join(f"{a} {getattr(self, a)}" for a in AXES) + f" = {self.world_size} ranks"

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along every axis (row-major over :data:`AXES`, innermost ``tp``)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        out: dict[str, int] = {}
        rest = rank
        for a in reversed(AXES):
            d = getattr(self, a)
            out[a] = rest % d
            rest //= d
        return {a: out[a] for a in AXES}

    def mesh_axes(self, required: tuple[str, ...] = ()) -> tuple[str, ...]:
        """Axes of degree > 1 plus ``required`` ones, in :data:`AXES` order (``dp_shard`` when all are 1)."""
        axes = tuple(a for a in AXES if getattr(self, a) > 1 or a in required)
        return axes or ("dp_shard",)

    def build_mesh(self, device_type: str, axes: tuple[str, ...] | None = None) -> DeviceMesh:
        """The run's DeviceMesh over ``axes`` (default :meth:`mesh_axes`). Collective: all ranks call it.

        ``axes`` must list every axis of degree > 1; axes of degree 1 may be included (FSDP2 needs a
        ``dp_shard`` axis even with one rank). A world of one rank without a process group gets a
        single-rank group on an in-memory store, because DeviceMesh always needs one.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        axes = axes or self.mesh_axes()
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; the axes are {AXES}")
        missing = [a for a in AXES if getattr(self, a) > 1 and a not in axes]
        if missing:
            raise ValueError(f"axes {missing} have degree > 1 and must be part of the mesh")
        if self.world_size == 1 and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
            )
        ordered = tuple(a for a in AXES if a in axes)
        shape = tuple(getattr(self, a) for a in ordered)
        return init_device_mesh(device_type, shape, mesh_dim_names=ordered)
