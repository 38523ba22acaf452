"""Step time: compute at a fraction of peak, the pipeline bubble, and the communication that is not hidden.

**FLOPs** (Kaplan et al. 2020; Chowdhery et al. 2022, PaLM appendix B; the model-parallel issue's "6·N +
the attention term"): a transformer costs, per token, forward + backward,

    6·N + 12·L·h·s

N: parameters that take part in matmuls (all but a lookup-only input embedding: an untied Llama's
``tok_embeddings``, GPT's learned positions), L layers, h hidden size, s sequence length. 2·N + 4·L·h·s of
it is the forward, the rest backward (twice the forward). Other models are measured by
``torch.utils.flop_counter`` on the meta device (:mod:`paratrain.plan.trace`); a bare ``--params`` count
costs 6·N per token. Activation checkpointing recomputes the forward of every layer in backward: + a third
of the layers' FLOPs. MFU (PaLM's definition) counts the model's FLOPs only, never the recomputation.

**Compute time** of a rank = its FLOPs / (peak × efficiency): the layers of its pipeline stage, ÷ tp, for the
samples of its data-parallel shard.

**Pipeline** (Narayanan et al. 2021): each of the ``grad_accum`` micro-steps runs m micro-batches through p
stages in (m + p − 1) slots of one micro-batch's time on the slowest stage; the bubble is the fraction
(p − 1)/(m + p − 1) of it.

**Overlap**, stated: collectives run on their own streams, on a link no other collective of the same
phase uses at the same time, and hide behind compute of their phase only:

- ``forward`` (FSDP's prefetched all-gathers) behind the forward, exposed = max(0, T − t_fwd);
- ``backward`` (FSDP's backward all-gathers, every micro-batch) and ``grad_sync`` (DDP's bucketed
  all-reduce, ZeRO's reduce-scatter, HSDP's replica all-reduce: launched on the last micro-batch only, as
  buckets fill) behind backward: each of the M = grad_accum × m micro-batches hides its share of the
  gathers behind its own backward, and the last one also the gradient sync:
  exposed = (M − 1)·max(0, T_b/M − t_b/M) + max(0, T_b/M + T_sync − t_b/M);
- ``step`` (ZeRO-1/2's parameter all-gather after the optimizer step) and ``exposed`` (TP collectives,
  which the next matmul waits for, and pipeline sends) are not hidden.

Step time = compute (with the bubble) + exposed communication.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.comm import CommOp, Link, op_time
from paratrain.plan.model import ModelSpec


def model_flops_per_sample(spec: ModelSpec, seq_len: int) -> float:
    """Forward + backward FLOPs of one sample (one sequence of ``seq_len`` tokens), without recomputation.

    This is the numerator of MFU; a benchmark or trainer that reports MFU should call this same function.
    """
    if spec.shape is not None:
        sh = spec.shape
        return seq_len * (6.0 * spec.matmul_params + 12.0 * sh.n_layers * sh.dim * seq_len)
    if spec.profile is not None:
        return spec.profile.flops
    return 6.0 * spec.num_params * seq_len


def stage_flops_per_sample(spec: ModelSpec, seq_len: int, layers: int, last: bool, recompute: bool) -> float:
    """FLOPs of one sample on a pipeline stage of ``layers`` layers (+ the output head on the last stage)."""
    total = model_flops_per_sample(spec, seq_len)
    if spec.shape is None or not spec.layers:
        return total * (4 / 3 if recompute else 1.0)
    sh = spec.shape
    layer_params = (sum(g.total for g in spec.layers) - spec.inactive_params) / len(spec.layers)
    per_layer = seq_len * (6.0 * layer_params + 12.0 * sh.dim * seq_len)
    head = total - sh.n_layers * per_layer  # the output projection (and anything outside the layers)
    return layers * per_layer * (4 / 3 if recompute else 1.0) + (head if last else 0.0)


@dataclass(frozen=True)
class StepTime:
    compute: float
    """Seconds of compute on the critical stage, recomputation included, bubble excluded."""
    bubble: float
    """Seconds the pipeline stage waits (fill and drain)."""
    comm: float
    """Seconds all collectives would take back to back."""
    exposed: float
    """Seconds of communication not hidden behind compute."""
    exposed_by_axis: dict[str, float]

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.exposed

    def to_dict(self) -> dict[str, float]:
        return {"compute": self.compute, "bubble": self.bubble, "exposed_comm": self.exposed,
                "comm_total": self.comm, "step": self.total}  # fmt: skip


def step_time(
    compute: float, recompute: bool, ops: list[tuple[CommOp, Link]], *, micro: int = 1, accum: int = 1,
    pp: int = 1,
) -> StepTime:  # fmt: skip
    """Combine a stage's compute seconds (per step, recomputation included) with its collectives."""
    plain = compute / (4 / 3) if recompute else compute  # forward 1/3, backward 2/3 of the plain compute
    t_fwd, t_bwd = plain / 3, compute - plain / 3
    big_m = max(1, accum * micro)
    by_phase: dict[str, float] = {}
    exposed_axis: dict[str, float] = {}
    for op, link in ops:
        secs = op_time(op, link)
        by_phase[op.phase] = by_phase.get(op.phase, 0.0) + secs
        if op.phase in ("step", "exposed"):
            exposed_axis[op.axis] = exposed_axis.get(op.axis, 0.0) + secs
    fwd = max(0.0, by_phase.get("forward", 0.0) - t_fwd)
    tb, sync = by_phase.get("backward", 0.0), by_phase.get("grad_sync", 0.0)
    bwd = (big_m - 1) * max(0.0, (tb - t_bwd) / big_m) + max(0.0, (tb - t_bwd) / big_m + sync)
    if fwd + bwd:
        exposed_axis["dp"] = exposed_axis.get("dp", 0.0) + fwd + bwd
    bubble = compute * (pp - 1) / micro if pp > 1 else 0.0
    return StepTime(
        compute=compute, bubble=bubble, comm=sum(by_phase.values()), exposed=sum(exposed_axis.values()),
        exposed_by_axis=exposed_axis,
    )  # fmt: skip
