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
open, :func:`paratrain.spec.presets.resolve`), with a message that prints every factor. The planner
uses the same object as its layout. Each worker builds one DeviceMesh from it
(:func:`paratrain.parallel.topology.build_mesh`) and every strategy uses sub-meshes of that one mesh
(``mesh["tp"]``, ``mesh["dp_replicate", "dp_shard"]``, ...). This module never imports torch.

Reference: https://pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.errors import ConfigError

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
    ep: int = 1
    """Expert-parallel degree: the experts of each MoE layer are split over ``ep`` ranks borrowed from the
    data-parallel and tensor-parallel ranks of a stage (:mod:`paratrain.parallel.expert`); not a factor of the
    world size."""

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
        borrowed = self.dp_replicate * self.dp_shard * self.tp
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1 or borrowed % self.ep:
            raise ConfigError(
                f"topology: ep {self.ep} must divide the ranks it borrows, dp_replicate {self.dp_replicate} x "
                f"dp_shard {self.dp_shard} x tp {self.tp} = {borrowed}. Give an --ep that divides {borrowed}."
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

    @classmethod
    def of(
        cls, *, dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, pp: int = 1, ep: int = 1
    ) -> Topology:
        """The topology of these degrees (the world size is their product; ``ep`` borrows from them)."""
        return cls(
            dp_replicate * dp_shard * tp * pp,
            dp_replicate=dp_replicate,
            dp_shard=dp_shard,
            tp=tp,
            pp=pp,
            ep=ep,
        )

    # ---- derived ---------------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """Ranks that see different data: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def gpus(self) -> int:
        """The world size, as the planner calls it."""
        return self.world_size

    @property
    def dp(self) -> int:
        """Alias of :attr:`dp_size` (the planner's name)."""
        return self.dp_size

    def degree(self, axis: str) -> int:
        return int(getattr(self, axis))

    def stride(self, axis: str) -> int:
        """Distance in rank numbers between neighbours of ``axis``'s groups (the product of the degrees of the
        axes inside it)."""
        inner = AXES[AXES.index(axis) + 1 :]
        return math.prod(self.degree(a) for a in inner)

    def degrees(self) -> dict[str, int]:
        """The degree of every mesh axis, and ``ep`` when experts are split."""
        return {a: getattr(self, a) for a in AXES} | ({"ep": self.ep} if self.ep > 1 else {})

    def to_dict(self) -> dict[str, int]:
        """The degrees as the planner's JSON ``layout`` reports them (``ep`` when experts are split)."""
        out = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp}
        return out | ({"ep": self.ep} if self.ep > 1 else {})

    def short(self) -> str:
        """``dp_replicate x dp_shard x tp x pp`` as ``RxSxTxP``."""
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp}x{self.pp}"

    def describe(self) -> str:
        ep = f" (experts: ep {self.ep})" if self.ep > 1 else ""
        return " x ".join(f"{a} {getattr(self, a)}" for a in AXES) + f" = {self.world_size} ranks{ep}"

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
