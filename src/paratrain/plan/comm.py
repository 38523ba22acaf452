"""What a layout communicates per step, costed with the α–β model of :mod:`paratrain.spec.cost` on each link.

The cost model itself (α per message, β per byte, γ per byte reduced), the time of every algorithm of
:mod:`paratrain.comm`, and nccl-tests' algbw/busbw conventions are defined once, in
:mod:`paratrain.spec.cost` (whose docstring has the table), and imported here: prediction and measurement
share one vocabulary. The bytes a rank *sends* in one collective are S × the bus factor (2(n−1)/n for
all_reduce, (n−1)/n for all_gather and reduce_scatter, 1 for broadcast, reduce and point-to-point).

**Planning** (:func:`op_time`, :func:`link_for`). A training step's collectives (built by
:func:`step_ops`) run the way NCCL runs them on GPUs: ring all-gather / reduce-scatter, and the
faster of ring and a pipelined double binary tree (2⌈log2 n⌉α + 2Sβ) for all-reduce; γ is negligible on a
GPU and left out. Each axis's groups are placed by the mesh layout (tp innermost, then dp_shard,
dp_replicate, pp): an axis whose ranks are ``stride`` apart spans ``stride × degree`` consecutive ranks and
stays inside a node when that is at most ``gpus_per_node``; otherwise it crosses nodes, with k =
gpus_per_node / stride members per node (at least 1), over degree / k nodes. A ring across nodes has one
inter-node hop per node, and NCCL spreads its channels over the node's NICs, so a group with k members per
node drives k NICs: 1/β = min(intra_bw, k × inter_bw). Latency follows NCCL's tuning model
(``src/graph/tuning.cc``): of a ring all-reduce's 2(n−1) steps, 2(nodes−1) cross the network and pay
``inter_latency``, the rest ``intra_latency`` (all-gather / reduce-scatter: n−1 and nodes−1); a tree's
2⌈log2 n⌉ steps likewise, 2⌈log2 nodes⌉ of them across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.plan.layout import Layout

# The measurement vocabulary (nccl-tests' bus factors, algbw/busbw) and the α–β costs of paratrain's own
# algorithms are defined once, in :mod:`paratrain.spec.cost`, and shared by prediction and measurement.
from paratrain.spec.cost import (
    BUS_FACTORS,
    PIECE_BYTES,
    LinkModel,
    algbw,
    bus_factor,
    busbw,
    predict,
    ring_pieces,
)
from paratrain.spec.hardware import Cluster

__all__ = [
    "BUS_FACTORS",
    "PIECE_BYTES",
    "CommOp",
    "Link",
    "LinkModel",
    "algbw",
    "bus_factor",
    "busbw",
    "link_for",
    "op_time",
    "predict",
    "ring_pieces",
    "step_ops",
]


# ---- planning: one step's collectives on a cluster ---------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """Where an axis's collectives run."""

    alpha_intra: float
    """Seconds per algorithm step inside a node."""
    alpha_inter: float
    """Seconds per algorithm step that crosses nodes."""
    beta: float
    """Seconds per byte (1 / the busbw the group can reach)."""
    nodes: int
    """Nodes one group spans (1: inside a node)."""

    def latency(self, steps: int, inter_steps: int) -> float:
        inter = min(steps, inter_steps) if self.nodes > 1 else 0
        return (steps - inter) * self.alpha_intra + inter * self.alpha_inter


def link_for(layout: Layout, axis: str, cluster: Cluster) -> Link:
    """The link ``axis``'s groups use under the mesh layout (see the module docstring)."""
    stride, degree = layout.stride(axis), layout.degree(axis)
    if stride * degree <= cluster.gpus_per_node:
        return Link(cluster.intra_latency, cluster.inter_latency, 1 / cluster.intra_bw, 1)
    per_node = max(1, min(degree, cluster.gpus_per_node // stride))
    beta = 1 / min(cluster.intra_bw, per_node * cluster.inter_bw)
    return Link(cluster.intra_latency, cluster.inter_latency, beta, -(-degree // per_node))


@dataclass(frozen=True)
class CommOp:
    """One kind of collective on one axis over a whole step: ``calls`` messages of ``nbytes`` S in total."""

    axis: str
    kind: str
    """all_reduce, all_gather, reduce_scatter or send_recv."""
    n: int
    """Ranks in the group (2 for send_recv)."""
    nbytes: float
    """S summed over the step's calls (nccl-tests' S: the gathered size for all_gather)."""
    calls: int
    phase: str
    """When it runs, for the overlap model (:mod:`paratrain.plan.time`): ``forward`` (overlaps forward compute),
    ``backward`` (every micro-batch's backward), ``grad_sync`` (the last micro-batch's backward), ``step``
    (after backward, exposed) or ``exposed`` (on the critical path: TP, PP)."""

    @property
    def sent(self) -> float:
        """Bytes each rank sends: S × busbw factor (2(n−1)/n·S for all_reduce)."""
        return self.nbytes * bus_factor(self.kind, self.n)

    @property
    def key(self) -> str:
        return f"{self.axis}.{self.kind}"


def op_time(op: CommOp, link: Link) -> float:
    """Seconds of ``op`` on ``link``: ring (or the faster double binary tree for all-reduce)."""
    n, s, calls, nodes = op.n, op.nbytes, op.calls, link.nodes
    if op.kind == "send_recv":
        return calls * link.latency(1, 1) + s * link.beta
    if n == 1 or calls == 0:
        return 0.0
    frac = (n - 1) / n
    if op.kind == "all_reduce":
        ring = calls * link.latency(2 * (n - 1), 2 * (nodes - 1)) + 2 * frac * s * link.beta
        depth = math.ceil(math.log2(n))
        tree = calls * link.latency(2 * depth, 2 * math.ceil(math.log2(nodes))) + 2 * s * link.beta
        return min(ring, tree)
    if op.kind in ("all_gather", "reduce_scatter"):
        return calls * link.latency(n - 1, nodes - 1) + frac * s * link.beta
    raise ValueError(f"no cost model for {op.kind!r}")


def step_ops(
    *,
    layout: Layout,
    sharding: str,
    psi: float,
    grad_bytes: int,
    param_bytes: int,
    compute_bytes: float,
    units: int,
    bucket_bytes: float,
    accum: int = 1,
    tokens_bytes: float = 0.0,
    layers: int = 0,
    passes: int = 1,
    sequence_parallel: bool = True,
    recompute: float | bool = False,
    first: bool = False,
    last: bool = False,
    chunks: int = 1,
    sync_every_accum: bool = False,
) -> list[CommOp]:
    """The collectives one rank issues in one optimizer step.

    ``psi``: parameters on this rank before data-parallel sharding (after tp and pp); ``units``: FSDP units
    (or 1); ``tokens_bytes``: s·b·h × activation bytes, one micro-batch's hidden states (the TP/PP message);
    ``layers``: transformer layers on this stage; ``passes``: micro-batches this stage runs per step
    (grad_accum × pipeline micro-batches); ``first``/``last``: the stage holds the embedding / the output.

    - Data parallel: ``none``: one all-reduce of the gradients (2Ψ) over dp_replicate, in buckets. ZeRO-1/2:
      reduce-scatter of the gradients during backward + all-gather of the parameters after the step (2Ψ).
      FSDP: all-gather before each unit's forward and again before its backward, reduce-scatter of its
      gradients (3Ψ; the gathers repeat on every accumulation micro-step), plus, with dp_replicate > 1
      (HSDP), an all-reduce of the gradient shard (2Ψ/dp_shard) across replicas. With ``sync_every_accum``
      (``--shard-accumulated-grads``) the gradient sync repeats on every micro-step too, the earlier ones
      behind the next micro-step's backward.
    - Tensor parallel (Megatron; Korthikanti et al. section 4.2.2): per layer and micro-batch, forward 2
      all-reduces of s·b·h and backward 2; with sequence parallelism forward 2 all-gathers + 2
      reduce-scatters and backward the same; recomputation repeats the forward ones. The vocabulary-parallel
      embedding adds one forward all-reduce (reduce-scatter with SP); the output projection one backward
      all-reduce (SP: a forward all-gather and a backward reduce-scatter).
    - Pipeline: per micro-batch, activations to the next stage and their gradients back to the previous
      (s·b·h, ÷ t with SP), sent by the busiest stage: two messages per micro-batch (one if pp = 2).
    """
    ops: list[CommOp] = []
    n, r = layout.dp_shard, layout.dp_replicate
    grads = psi * grad_bytes
    buckets = max(1, math.ceil(grads / bucket_bytes)) if bucket_bytes > 0 else 1
    if sharding == "none" and r > 1:
        ops.append(CommOp("dp_replicate", "all_reduce", r, grads, buckets, "grad_sync"))
    elif sharding in ("optimizer", "grads") and n > 1:
        ops.append(CommOp("dp_shard", "reduce_scatter", n, grads, buckets, "grad_sync"))
        ops.append(CommOp("dp_shard", "all_gather", n, psi * param_bytes, buckets, "step"))
    elif sharding == "full":
        if n > 1:
            gathered = psi * compute_bytes * accum
            ops.append(CommOp("dp_shard", "all_gather", n, gathered, units * accum, "forward"))
            ops.append(CommOp("dp_shard", "all_gather", n, gathered, units * accum, "backward"))
            ops.append(CommOp("dp_shard", "reduce_scatter", n, grads, units, "grad_sync"))
        if r > 1:
            ops.append(CommOp("dp_replicate", "all_reduce", r, grads / n, units, "grad_sync"))
        if sync_every_accum and accum > 1:  # the earlier micro-steps' syncs, overlapped with backward
            early = [CommOp(o.axis, o.kind, o.n, o.nbytes * (accum - 1), o.calls * (accum - 1), "backward")
                     for o in ops if o.phase == "grad_sync"]  # fmt: skip
            ops.extend(early)
    t = layout.tp
    if t > 1 and tokens_bytes > 0:
        # per layer: 2 forward + 2 backward (+ 2 forward again when recomputed); each is an all-reduce, or
        # with SP an all-gather *and* a reduce-scatter (the same bytes: (t-1)/t·S each vs 2(t-1)/t·S)
        count = round(layers * (4 + 2 * float(recompute))) + int(first) + int(last)
        kinds = ("all_gather", "reduce_scatter") if sequence_parallel else ("all_reduce",)
        for kind in kinds:
            ops.append(CommOp("tp", kind, t, passes * count * tokens_bytes, passes * count, "exposed"))
    if layout.pp > 1 and tokens_bytes > 0:
        sends = passes * (2 if layout.pp > 2 else 1) * chunks
        size = tokens_bytes / (t if sequence_parallel else 1)
        ops.append(CommOp("pp", "send_recv", 2, sends * size, sends, "exposed"))
    return ops
