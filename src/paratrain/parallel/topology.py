"""The run's one DeviceMesh, built from its :class:`~paratrain.spec.topology.Topology`.

The topology (degrees, axis order, strides) is torch-free and lives in :mod:`paratrain.spec.topology`; this
module adds the only part that needs torch: the :class:`~torch.distributed.device_mesh.DeviceMesh` with one
named axis per parallel dimension, ``tp`` innermost.

Reference: https://pytorch.org/tutorials/recipes/distributed_device_mesh.html
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paratrain.spec.topology import AXES, Topology

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["AXES", "Topology", "build_mesh"]


def build_mesh(topology: Topology, device_type: str, axes: tuple[str, ...] | None = None) -> DeviceMesh:
    """The run's DeviceMesh over ``axes`` (default :meth:`Topology.mesh_axes`). Collective: all ranks call it.

    ``axes`` must list every axis of degree > 1; axes of degree 1 may be included (FSDP2 needs a
    ``dp_shard`` axis even with one rank). A world of one rank without a process group gets a
    single-rank group on an in-memory store, because DeviceMesh always needs one.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    axes = axes or topology.mesh_axes()
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"unknown mesh axes {unknown}; the axes are {AXES}")
    missing = [a for a in AXES if getattr(topology, a) > 1 and a not in axes]
    if missing:
        raise ValueError(f"axes {missing} have degree > 1 and must be part of the mesh")
    if topology.world_size == 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    ordered = tuple(a for a in AXES if a in axes)
    shape = tuple(getattr(topology, a) for a in ordered)
    return init_device_mesh(device_type, shape, mesh_dim_names=ordered)
