"""Hierarchical all-reduce over several hosts: shared memory inside a node, the native backend between.

    intra, inter = make_hierarchical_groups()          # collective, once (LOCAL_WORLD_SIZE ranks per node)
    hierarchical_all_reduce(grad, "mean", intra, inter)

Schedule of one call, on every rank: (1) shm reduce-scatter of the flat tensor among the node's ranks
(``intra``), each rank ending with the node's sum of one ``tensor_split`` chunk; (2) a native
``dist.all_reduce`` of that chunk among the ranks with the same local index on every node (``inter``,
one per node: NCCL or Gloo over the network); (3) shm all-gather of the chunks inside the node. Each byte
crosses the network once per node instead of once per rank, and the node-local steps never touch a socket.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._common import chunk_bounds
from paratrain.comm._shm_ops import check_op, native_op, normalize_op


def make_hierarchical_groups(local_size: int | None = None) -> tuple[Any, Any]:
    """``(intra, inter)`` groups of this rank for :func:`hierarchical_all_reduce`: ranks are numbered node
    by node (torchrun does), ``local_size`` per node (default ``LOCAL_WORLD_SIZE``). ``intra``: this
    node's ranks; ``inter``: the ranks with this rank's local index on every node. Collective (both
    families of groups are created on every rank, once)."""
    world = dist.get_world_size()
    local = local_size or int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        raise ValueError(
            f"make_hierarchical_groups: local size {local} does not divide the world size {world}."
        )
    nodes = world // local
    intra, _ = dist.new_subgroups_by_enumeration(
        [[i * local + j for j in range(local)] for i in range(nodes)]
    )
    inter, _ = dist.new_subgroups_by_enumeration(
        [[i * local + j for i in range(nodes)] for j in range(local)]
    )
    return intra, inter


@torch.no_grad()
def hierarchical_all_reduce(
    tensor: torch.Tensor, op: Any = "sum", intra_group: Any = None, inter_group: Any = None
) -> torch.Tensor:
    """All-reduce over ``intra × inter`` (in place): shm reduce-scatter inside the node, a native
    all-reduce of this rank's chunk among the ranks with the same local index (``inter_group``, one per
    node), shm all-gather inside the node. Each byte crosses the network once per node, not once per rank.

    The chunks are ``torch.tensor_split`` parts of the flat tensor over the node's ranks, so every rank
    of ``inter_group`` holds a chunk of the same length (the nodes have the same size).
    """
    op = normalize_op(op)
    check_op("shm hierarchical_all_reduce", op, tensor.dtype)
    from paratrain.comm.shm import get_communicator  # shm re-exports this module: import at call time

    intra = get_communicator(intra_group)
    inter_size = dist.get_world_size(inter_group) if dist.is_initialized() else 1
    if tensor.numel() == 0 or intra.size * inter_size == 1:
        return tensor
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    flat = buf.view(-1)
    bounds = chunk_bounds(flat.numel(), intra.size)
    lo, hi = bounds[intra.rank]
    inner = "sum" if op == "mean" else op
    chunk = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
    intra.reduce_scatter_flat(flat, bounds, inner, chunk)
    if inter_size > 1 and chunk.numel():
        dist.all_reduce(chunk, op=native_op(inner), group=inter_group)
    if op == "mean":
        chunk.div_(intra.size * inter_size)
    intra.all_gather_flat(chunk, bounds, flat)
    if buf is not tensor:
        tensor.copy_(buf)
    return tensor
