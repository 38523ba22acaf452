"""One validated topology object and the DeviceMesh built from it (torchtitan's ``ParallelDims``).

A run's ranks are laid out on a grid of named *axes* (a mesh dimension is an "axis"; "dim" is kept for
tensor dimensions)::

    pp x replicate x shard x tp == world_size

- ``replicate``: data-parallel axis whose ranks hold full replicas of their shard (HSDP's outer axis,
  gradients are all-reduced across it);
- ``shard``: data-parallel axis whose ranks each hold 1/``shard`` of the parameters / gradients /
  optimizer state (FSDP, ZeRO);
- ``tp``, ``pp``: tensor- and pipeline-parallel degrees (reserved for those strategies).

The degrees are checked once, in the launching process, with a message that prints every factor; workers
build the :class:`~torch.distributed.device_mesh.DeviceMesh` from the same object. Nothing here is a
module-level singleton: a mesh is passed explicitly to whoever needs it.

Reference: https://pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paratrain.config import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Order of the axes in the mesh, outermost first. The innermost axis gets consecutive ranks, so on a
#: multi-node job ``tp`` (the chattiest) stays inside a node and ``replicate`` crosses nodes.
AXES: tuple[str, ...] = ("pp", "replicate", "shard", "tp")


@dataclass(frozen=True)
class Topology:
    """Degrees of every parallel axis; ``pp * replicate * shard * tp`` must equal ``world_size``."""

    world_size: int
    """Total number of ranks."""
    replicate: int = 1
    """Data-parallel replicas (HSDP's outer axis)."""
    shard: int = 1
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
        product = self.pp * self.replicate * self.shard * self.tp
        if product != self.world_size:
            raise ConfigError(
                f"topology: pp {self.pp} x replicate {self.replicate} x shard {self.shard} x tp {self.tp} "
                f"= {product}, but the world size is {self.world_size}. Choose degrees whose product is "
                f"{self.world_size} (for example --shard-size a divisor of {self.world_size})."
            )

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def infer(
        cls, world_size: int, *, replicate: int = 1, shard: int = -1, tp: int = 1, pp: int = 1
    ) -> Topology:
        """Fill in the one degree given as ``-1`` so that the product is ``world_size``.

        Raises :class:`ConfigError` (printing every factor) when the others do not divide ``world_size``.
        """
        degrees = {"replicate": replicate, "shard": shard, "tp": tp, "pp": pp}
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
        """Ranks that see different data: ``replicate * shard``."""
        return self.replicate * self.shard

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

    def build_mesh(self, device_type: str, axes: tuple[str, ...] | None = None) -> DeviceMesh:
        """The DeviceMesh over ``axes`` (default: every axis of degree > 1, or ``shard`` when all are 1).

        ``axes`` must list every axis of degree > 1 (in :data:`AXES` order; axes of degree 1 may be
        included, e.g. HSDP's ``("replicate", "shard")`` with one replica). Collective: all ranks call it.
        """
        from torch.distributed.device_mesh import init_device_mesh

        if axes is None:
            axes = tuple(a for a in AXES if getattr(self, a) > 1) or ("shard",)
        unknown = [a for a in axes if a not in AXES]
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}; the axes are {AXES}")
        missing = [a for a in AXES if getattr(self, a) > 1 and a not in axes]
        if missing:
            raise ValueError(f"axes {missing} have degree > 1 and must be part of the mesh")
        ordered = tuple(a for a in AXES if a in axes)
        shape = tuple(getattr(self, a) for a in ordered)
        return init_device_mesh(device_type, shape, mesh_dim_names=ordered)
