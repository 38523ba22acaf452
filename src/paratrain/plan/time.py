"""Step time: compute at a fraction of peak, the pipeline bubble, and the communication that is not hidden.

**FLOPs** (Kaplan et al. 2020; Chowdhery et al. 2022, PaLM appendix B; 6·N plus
the attention term): a transformer costs, per token, forward + backward,

    6·N + 12·L·h·s

N: parameters that take part in matmuls (all but a lookup-only input embedding: an untied Llama's
``tok_embeddings``, GPT's learned positions), L layers, h hidden size, s sequence length. 2·N + 4·L·h·s of
it is the forward, the rest backward (twice the forward). Other models are measured by
``torch.utils.flop_counter`` on the meta device (:mod:`paratrain.plan.trace`); a bare ``--params`` count
costs 6·N per token. Full activation checkpointing recomputes the forward of every layer in backward: + a
third of the layers' FLOPs. Selective (op-level) checkpointing reruns only the matmuls it does not keep (wk,
wo, w3 of a Llama layer; attention is kept), a fraction r = (h·kv + h² + h·f)/(2h² + 2h·kv + 3h·f) of a layer's
matmul forward (0.37 for Llama 3 8B); ``selective:N`` reruns 1/N of the layers. MFU (PaLM's definition) counts the model's FLOPs only, never the recomputation.

**Compute time** of a rank = its FLOPs / (peak × efficiency): the layers of its pipeline stage, ÷ tp, for the
samples of its data-parallel shard.

**Pipeline** (Narayanan et al. 2021): each of the ``grad_accum`` micro-steps runs m micro-batches through p
stages in (m + p − 1) slots of one micro-batch's time on the slowest stage; the bubble is the fraction
(p − 1)/(m + p − 1) of it. Interleaved 1F1B with v chunks per rank: (p − 1)/(v·m + p − 1); each chunk boundary
is one more send, v times the messages.

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


def recompute_fraction(spec: ModelSpec, mode: str, every: int = 1) -> float:
    """Fraction of the layers' forward FLOPs that activation checkpointing ``mode`` reruns in backward."""
    if mode == "none":
        return 0.0
    if mode == "every":
        return 1.0 / every
    if mode == "selective":
        if spec.shape is None:
            return 0.0  # convolutions and matmuls are kept: only the cheap ops rerun
        h, kv, f = spec.shape.dim, spec.shape.kv_dim, spec.shape.ffn_hidden
        return (h * kv + h * h + h * f) / (2 * h * h + 2 * h * kv + spec.shape.mlp_matrices * h * f)
    return 1.0


def tp_rerun(mode: str, every: int = 1) -> float:
    """Fraction of a layer's forward TP collectives rerun in backward (selective keeps them)."""
    return {"none": 0.0, "selective": 0.0, "every": 1.0 / every}.get(mode, 1.0)


def stage_flops_per_sample(
    spec: ModelSpec, seq_len: int, layers: int, last: bool, recompute: float | bool
) -> float:
    """FLOPs of one sample on a pipeline stage of ``layers`` layers (+ the output head on the last stage);
    ``recompute``: the fraction of the layers' forward rerun (True: all of it)."""
    redo = float(recompute)
    total = model_flops_per_sample(spec, seq_len)
    if spec.shape is None or not spec.layers:
        return total * (1 + redo / 3)
    sh = spec.shape
    layer_params = (sum(g.total for g in spec.layers) - spec.inactive_params) / len(spec.layers)
    per_layer = seq_len * (6.0 * layer_params + 12.0 * sh.dim * seq_len)
    head = total - sh.n_layers * per_layer  # the output projection (and anything outside the layers)
    return layers * per_layer * (1 + redo / 3) + (head if last else 0.0)


def stage_attention_flops_per_sample(
    spec: ModelSpec, seq_len: int, layers: int, recompute: float | bool
) -> float:
    """The part of :func:`stage_flops_per_sample` in attention's score and value products (12·h·s per token and
    layer, and the recomputed forward); 0 for a model without a transformer shape."""
    if spec.shape is None or not spec.layers:
        return 0.0
    return layers * seq_len * 12.0 * spec.shape.dim * seq_len * (1 + float(recompute) / 3)


def stage_linear_flops_per_sample(
    spec: ModelSpec, seq_len: int, layers: int, recompute: float | bool
) -> float:
    """The part of :func:`stage_flops_per_sample` in the layers' linear matmuls (6 FLOPs per token per weight,
    and the recomputed forward): what ``--fp8`` runs at the fp8 peak. Attention's score and value products
    (the 12·h·s term) and the output layer are not in it; a model without a transformer shape has none."""
    if spec.shape is None or not spec.layers:
        return 0.0
    layer_params = (sum(g.total for g in spec.layers) - spec.inactive_params) / len(spec.layers)
    return layers * seq_len * 6.0 * layer_params * (1 + float(recompute) / 3)


ATTENTION_RELATIVE = 0.6
"""Attention's score and value products (flash attention) run at this fraction of a wide matmul's efficiency
when the width model is on (:func:`compute_slowdown`): fitted with ``MATMUL_KNEE`` (docs/plan.md)."""
SHAPELESS_WIDTH = 4096
"""A model without a transformer shape (a traced module, a bare parameter count) is timed as matmuls this
wide when the width model is on."""


def _narrow(width: float, knee: float) -> float:
    """1/g: how much slower than a wide matmul one whose narrowest side is ``width`` runs."""
    return (width + knee) / width


def linear_gemms(spec: ModelSpec, tp: int, tokens: float) -> list[tuple[float, float, float, float]]:
    """A layer's linear matmuls on one rank, ``(K, N, M, count)``: input width, output width (the tensor-parallel
    side ÷ tp), rows (the micro-batch's tokens) and how many such products; an MoE model's routed experts as one
    grouped product over the tokens routed to them (``top_k`` per token), averaged over its dense and MoE layers."""
    sh = spec.shape
    assert sh is not None
    h, kv, f, q, m = sh.dim, sh.kv_dim, sh.ffn_hidden, sh.n_heads * sh.head_dim, tokens
    if sh.arch == "gpt":
        attn = [(h, 3 * h / tp, m, 1.0), (h / tp, h, m, 1.0)]
    else:
        attn = [(h, q / tp, m, 1.0), (h, kv / tp, m, 2.0), (q / tp, h, m, 1.0)]
    gate = [(h, f / tp, m, 1.0)] if sh.mlp_matrices == 3 else []
    dense = [(h, f / tp, m, 1.0), (f / tp, h, m, 1.0), *gate]
    moe = spec.moe
    if moe is None:
        return attn + dense
    share = moe.moe_layers / sh.n_layers
    mh = moe.moe_hidden
    experts = [(h, mh / tp, m * moe.top_k, 2.0 * share), (mh / tp, h, m * moe.top_k, share)]
    shared = [
        (h, mh / tp, m, 2.0 * share * moe.n_shared_experts),
        (mh / tp, h, m, share * moe.n_shared_experts),
    ]
    return attn + [(k, n, r, c * (1 - share)) for k, n, r, c in dense] + experts + [g for g in shared if g[3]]


def compute_slowdown(spec: ModelSpec, tp: int, tokens: float, knee: float) -> dict[str, float]:
    """The width model's slowdowns (≥ 1) of a stage's compute parts against a wide matmul at the cluster's
    efficiency: ``linear`` (the layers' linear matmuls, their FLOP-weighted mean of ``(w + knee) / w`` where ``w`` is
    a product's narrowest side on the rank), ``attention`` (1 / :data:`ATTENTION_RELATIVE`) and ``rest`` (the output
    layer, ``dim`` × ``vocab / tp``; everything of a model without a shape). ``knee`` 0: all 1 (the efficiency is
    the whole step's)."""
    if knee <= 0:
        return {"linear": 1.0, "attention": 1.0, "rest": 1.0}
    if spec.shape is None:
        slow = _narrow(SHAPELESS_WIDTH, knee)
        return {"linear": slow, "attention": slow, "rest": slow}
    gemms = linear_gemms(spec, tp, tokens)
    flops = sum(k * n * r * c for k, n, r, c in gemms)
    linear = sum(k * n * r * c * _narrow(min(k, n, r), knee) for k, n, r, c in gemms) / flops
    sh = spec.shape
    head = _narrow(min(sh.dim, sh.vocab_size / tp, tokens), knee)
    return {"linear": linear, "attention": 1 / ATTENTION_RELATIVE, "rest": head}


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
    compute: float, recompute: float | bool, ops: list[tuple[CommOp, Link]], *, micro: int = 1, accum: int = 1,
    pp: int = 1, schedule: str = "1f1b",
) -> StepTime:  # fmt: skip
    """Combine a stage's compute seconds (per step, recomputation included) with its collectives."""
    plain = compute / (1 + float(recompute) / 3)  # forward 1/3, backward 2/3 of the plain compute
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
    bubble = compute * (pp - 1) / (micro * (2 if schedule == "interleaved-1f1b" else 1)) if pp > 1 else 0.0
    return StepTime(
        compute=compute, bubble=bubble, comm=sum(by_phase.values()), exposed=sum(exposed_axis.values()),
        exposed_by_axis=exposed_axis,
    )  # fmt: skip
