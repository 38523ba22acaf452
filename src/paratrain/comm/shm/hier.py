"""Hierarchical all-reduce over several hosts: shared memory inside a node, the native backend between.

    intra, inter = make_hierarchical_groups()          # collective, once (LOCAL_WORLD_SIZE ranks per node)
    hierarchical_all_reduce(grad, "mean", intra, inter)

    groups = node_groups(group)                        # collective: None when the group is on one node
    ar = HierarchicalAllReduce(*groups)                # what training uses (ddp's hook, dp's buckets)
    ar.all_reduce(grad, "mean")

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
from paratrain.comm.shm.api import get_communicator
from paratrain.comm.shm.communicator import ShmCommunicator
from paratrain.comm.shm.ops import check_op, native_op, premultiply, split_premul
from paratrain.comm.shm.system import _host_info


def node_key() -> str:
    """What makes this process's node: its host (name and kernel boot id) and, under torchrun or
    ``paratrain launch``, its agent (``GROUP_RANK``), so two agents on one host count as two nodes."""
    info = _host_info()
    return f"{info['host']}/{info['boot']}/{os.environ.get('GROUP_RANK', '')}"


def nodes_of(group: Any = None) -> list[list[int]]:
    """The global ranks of ``group`` per node (:func:`node_key`), nodes in order of their first rank.
    Collective over the *default* group (every rank of the job calls it): it gathers every rank's node."""
    if not dist.is_initialized():
        return [[0]]
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, node_key())
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(keys)))
    by_node: dict[Any, list[int]] = {}
    for g in ranks:
        by_node.setdefault(keys[g], []).append(g)
    return list(by_node.values())


def node_groups(group: Any = None) -> tuple[Any, Any] | None:
    """``(intra, inter)`` groups for :func:`hierarchical_all_reduce` when the ranks of ``group`` are on
    several nodes (:func:`nodes_of`), ``None`` when they are all on one. Collective over the *default*
    group: every rank of the job calls it, in the same order. The nodes must hold the same number of the
    group's ranks, numbered node by node (torchrun's order); otherwise ``ValueError`` naming the layout."""
    nodes = nodes_of(group)
    if len(nodes) == 1:
        return None
    ranks = [g for node in nodes for g in node]
    local = len(nodes[0])
    if any(len(node) != local for node in nodes) or ranks != sorted(ranks):
        layout = "; ".join(f"node {i}: ranks {node}" for i, node in enumerate(nodes))
        raise ValueError(
            f"shm across nodes: the hierarchical all-reduce needs the same number of ranks on every node, "
            f"numbered node by node (as torchrun numbers them), but the group's ranks are laid out as "
            f"{layout}. Launch the same --nproc-per-node on every node, or use --comm-algorithm native."
        )
    return _groups(nodes)


def _groups(nodes: list[list[int]]) -> tuple[Any, Any]:
    """Create (collectively) one group per node and one per local index across the nodes; return this
    rank's two."""
    intra, _ = dist.new_subgroups_by_enumeration(nodes)
    inter, _ = dist.new_subgroups_by_enumeration([list(column) for column in zip(*nodes, strict=True)])
    return intra, inter


class HierarchicalAllReduce:
    """An all-reduce over several nodes with :class:`~paratrain.comm.shm.communicator.ShmCommunicator`'s interface
    (``all_reduce``, ``size``, ``close``): shm inside the node through a communicator of its own over
    ``intra_group`` (created here: collective over the node), the native backend over ``inter_group``."""

    @classmethod
    def for_group(cls, group: Any = None, **shm_kwargs: Any) -> HierarchicalAllReduce | None:
        """One over ``group`` when its ranks are on several nodes (:func:`node_groups`), else ``None``.
        Collective over the default group."""
        groups = node_groups(group)
        return None if groups is None else cls(*groups, **shm_kwargs)

    def __init__(self, intra_group: Any, inter_group: Any, **shm_kwargs: Any) -> None:

        self.intra = ShmCommunicator(intra_group, **shm_kwargs)
        self.inter = inter_group
        self.nodes = dist.get_world_size(inter_group)
        self.size = self.intra.size * self.nodes

    @torch.no_grad()
    def all_reduce(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        return hierarchical_all_reduce(tensor, op, self.intra, self.inter)

    def describe(self) -> str:
        return (
            f"hierarchical all-reduce over {self.nodes} nodes of {self.intra.size} ranks (shm inside each "
            "node, the backend's all-reduce between them)"
        )

    def close(self) -> None:
        self.intra.close()

    def __repr__(self) -> str:
        return f"HierarchicalAllReduce(size={self.size}, nodes={self.nodes})"


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
    return _groups([[i * local + j for j in range(local)] for i in range(world // local)])


@torch.no_grad()
def hierarchical_all_reduce(
    tensor: torch.Tensor, op: Any = "sum", intra_group: Any = None, inter_group: Any = None
) -> torch.Tensor:
    """All-reduce over ``intra × inter`` (in place): shm reduce-scatter inside the node (``intra_group``: a
    group, whose cached communicator is used, or a communicator), a native all-reduce of this rank's
    chunk among the ranks with the same local index (``inter_group``, one per node), shm all-gather
    inside the node. Each byte crosses the network once per node, not once per rank.

    The chunks are ``torch.tensor_split`` parts of the flat tensor over the node's ranks, so every rank
    of ``inter_group`` holds a chunk of the same length (the nodes have the same size).
    """
    op, factor = split_premul(op)
    if factor is not None:
        premultiply(tensor, factor, "shm hierarchical_all_reduce", out=tensor)
    check_op("shm hierarchical_all_reduce", op, tensor.dtype)

    intra = intra_group if isinstance(intra_group, ShmCommunicator) else get_communicator(intra_group)
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
