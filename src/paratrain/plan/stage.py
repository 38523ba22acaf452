"""What one pipeline stage of a layout holds and takes: the workload (the batch and training settings
``paratrain train`` takes), the stages worth evaluating, and a stage's peak moment (:mod:`paratrain.plan.peak`)
and step time (:mod:`paratrain.plan.comm`, :mod:`paratrain.plan.time`). :func:`paratrain.plan.api.evaluate`
combines the stages into one plan."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan import activations as act
from paratrain.plan import implementation as impl
from paratrain.plan import memory as mem
from paratrain.plan import peak as pk
from paratrain.plan.comm import link_for, step_ops
from paratrain.plan.layout import Layout
from paratrain.plan.model import ModelSpec, ParamGroup
from paratrain.plan.time import (
    compute_slowdown,
    recompute_fraction,
    stage_attention_flops_per_sample,
    stage_flops_per_sample,
    stage_linear_flops_per_sample,
    step_time,
    tp_rerun,
)
from paratrain.spec.hardware import Cluster

DEFAULT_BATCH = 64
"""``paratrain train``'s default global batch; the planner rounds it up to a multiple of the GPUs."""


@dataclass(frozen=True)
class Workload:
    """The batch and training settings (the flags ``paratrain train`` takes)."""

    batch_size: int | None = None
    """Global samples (sequences) per optimizer step; None: the smallest multiple of the GPUs >= 64."""
    seq_len: int | None = None
    """Tokens per sequence; None: the model's max_seq_len (1 for models that are not transformers)."""
    grad_accum: int = 1
    microbatches: int | None = None
    """Pipeline micro-batches per accumulation step; None: one sample each (the smallest bubble)."""
    activation_checkpointing: str | bool = "none"
    """``none``, ``full``, ``selective`` (op-level) or ``selective:N`` (``true``/``false``: full/none)."""
    optimizer: str = "adamw"
    momentum: float = 0.9
    optimizer_implementation: str = "auto"
    """``auto`` and ``fused``: torch's fused kernel (no temporaries); ``foreach``, ``for-loop`` (train's
    ``--set optimizer.implementation=...``)."""
    precision: str = "fp32"
    offload: bool = False
    attention: str = "sdpa"
    sequence_parallel: bool = True
    loss_parallel: bool = False
    """TP: keep the logits vocabulary-sharded through the loss (``--set strategy.loss_parallel=true`` in train);
    off, paratrain's output layer gathers them to the full vocabulary on every TP rank."""
    pp_schedule: str = "1f1b"
    moe_ep: int = 1
    """An MoE model's expert-parallel degree (1: every expert on each rank): the rows it keeps per layer."""
    moe_overload: float = 1.0
    """MoE: routed rows on the busiest rank over the mean (``--moe-overload``)."""
    fp8_all_gather: bool = False
    """FSDP all-gathers the layers' linear weights in float8 (torchao's ``Float8Linear`` with
    ``enable_fsdp_float8_all_gather``, torchtitan's ``[float8]`` setting): the unsharded weights (and the
    all-gather messages) are 1 byte per element instead of the compute dtype's 2; the embedding and output
    layer stay 16-bit. The matmuls' peak is :attr:`fp8`'s choice, not this one's."""
    fp8: bool = False
    """Float8 linears (torchao's ``Float8Linear``, torchtitan's ``[float8]``): the layers' linear matmuls run at
    the GPU's fp8 peak (:attr:`Cluster.fp8_flops`), attention's core and the output layer (which torchtitan
    leaves out) at the 16-bit one; the efficiency is the calibrated one of this compute
    (:func:`paratrain.spec.hardware.compute_key`). Memory is planned as the 16-bit run's."""
    compile: bool = False
    """``torch.compile`` (train's ``--compile``): time at the compiled efficiency of the GPU family; memory is
    planned as eager (fused kernels keep fewer activations)."""
    reduce_fp32: bool = False
    """FSDP under 16-bit compute: reduce-scatter the gradients, and accumulate them unsharded between
    micro-batches, in fp32 (``MixedPrecisionPolicy(reduce_dtype=float32)``, torchtitan's
    ``mixed_precision_reduce`` default; FSDP2 upcasts the accumulated gradient to the reduce dtype). paratrain's
    own FSDP reduces in the compute dtype (``--reduce-fp32`` off)."""
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    compile_loss: bool = False
    """The cross-entropy under ``torch.compile`` (torchtitan compiles it with ``--compile`` since April 2025;
    paratrain's ``--compile`` compiles the blocks only): one fused kernel keeps the logits in the compute dtype
    and writes one gradient of them, instead of the fp32 log-probabilities and two fp32 gradients."""
    pp_return_outputs: bool = False
    """Pipelines: the last stage keeps every micro-batch's output, the logits, in ``output_chunks`` until the
    next step (torch's ``schedule.step(return_outputs=True)``, its default, as torchtitan calls it; the
    planner's ``--pp-return-outputs``). paratrain's pipeline passes ``return_outputs=False``."""
    shard_accumulated_grads: bool = False
    """FSDP without a pipeline, ``grad_accum`` > 1: reduce-scatter on every accumulation micro-step and hold one
    gradient shard (train's ``--shard-accumulated-grads``) instead of the whole unsharded gradients."""

    def __post_init__(self) -> None:
        mode, every = act.checkpoint_policy(self.activation_checkpointing)
        object.__setattr__(
            self, "activation_checkpointing", f"selective:{every}" if mode == "every" else mode
        )
        mem.dtypes(self.precision, self.optimizer, self.momentum)  # validates both
        if self.attention not in act.ATTENTION:
            raise ConfigError(f"attention {self.attention!r}: choose one of {', '.join(act.ATTENTION)}.")
        if self.pp_schedule not in act.SCHEDULES:
            raise ConfigError(
                f"--pp-schedule {self.pp_schedule!r}: choose one of {', '.join(act.SCHEDULES)}."
            )
        for name in ("batch_size", "seq_len", "microbatches"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {v}.")
        if self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be at least 1, got {self.grad_accum}.")


@dataclass(frozen=True)
class Batch:
    global_batch: int
    seq_len: int
    accum: int
    micro: int  # pipeline micro-batches per accumulation step
    size: int  # samples per micro-batch on one rank


def batch_of(spec: ModelSpec, layout: Layout, w: Workload, gpus: int) -> Batch:
    b = w.batch_size or gpus * -(-DEFAULT_BATCH // gpus)
    seq = w.seq_len or (spec.shape.max_seq_len if spec.shape else 1)
    per_rank, left = divmod(b, layout.dp * w.grad_accum)
    if left or not per_rank:
        raise ConfigError(
            f"global batch {b} does not split into {layout.dp} data-parallel ranks x {w.grad_accum} accumulation "
            f"steps; choose --batch-size a multiple of {layout.dp * w.grad_accum}."
        )
    m = 1 if layout.pp == 1 else (w.microbatches or per_rank)
    size, left = divmod(per_rank, m)
    if left or not size:
        raise ConfigError(
            f"{per_rank} samples per rank and micro-step do not split into {m} pipeline micro-batches; choose "
            f"--microbatches a divisor of {per_rank}."
        )
    if layout.pp > 1 and w.pp_schedule == "interleaved-1f1b" and m % (rounds := max(1, m // layout.pp)):
        raise ConfigError(f"--pp-schedule interleaved-1f1b runs the micro-batches in rounds of --pp {layout.pp}: "
                          f"--microbatches {m} must be a multiple of {rounds} (e.g. {rounds * layout.pp}).")  # fmt: skip
    return Batch(b, seq, w.grad_accum, m, size)


def stages(spec: ModelSpec, pp: int) -> list[tuple[int, list[ParamGroup], bool, bool]]:
    """(stage index, layer groups, holds the embedding, holds the head) of the stages worth evaluating: the
    first, the last and the first one with the most layers (the others are never worse than these)."""
    if pp == 1:
        return [(0, list(spec.layers), True, True)]
    counts = act.split_layers(len(spec.layers), pp)
    starts = [sum(counts[:i]) for i in range(pp)]
    pick = sorted({0, pp - 1, counts.index(max(counts))})
    return [(i, list(spec.layers[starts[i] : starts[i] + counts[i]]), i == 0, i == pp - 1) for i in pick]


def _reduced_grad_bytes(sharding: str, w: Workload, d: mem.Dtypes) -> int:
    """Bytes per element of the gradients a step reduces and accumulates between micro-batches: FSDP's
    unsharded gradients are in the compute dtype, or fp32 with ``reduce_fp32``; the others' are stored ones."""
    if sharding != "full":
        return d.grad
    return 4 if w.reduce_fp32 else d.compute


def _gathered_bytes(spec: ModelSpec, st: Stage, t: int, w: Workload, d: mem.Dtypes) -> tuple[float, float]:
    """``(bytes per element of an all-gathered layer, of the stage's gathered parameters on average)``: the
    compute dtype, or 1 for the layers' weights with ``--fp8-all-gather`` (the norms' few weights included)."""
    if not w.fp8_all_gather:
        return float(d.compute), float(d.compute)
    unit, root = 1.0, st.root.per_rank(t)
    return unit, ((st.psi - root) * unit + root * d.compute) / st.psi if st.psi else float(d.compute)


def _pipeline_buffers(st: Stage, layout: Layout, w: Workload, batch: Batch, inp: float) -> float:
    """Bytes of torch's ``PipelineStage`` receive buffers on this rank: one stage boundary tensor (``inp``, a
    micro-batch's residual stream) per micro-batch for the activations of every local stage that is not the
    first and for the gradients of every one that is not the last; the in-flight micro-batches' activation
    buffers are the layer inputs the activations already count."""
    p = layout.pp
    if p == 1:
        return 0.0
    v = act.VIRTUAL_STAGES if w.pp_schedule == "interleaved-1f1b" else 1
    chunks = [st.index + k * p for k in range(v)]
    not_first = sum(1 for c in chunks if c > 0)
    not_last = sum(1 for c in chunks if c < v * p - 1)
    in_flight = act.in_flight(w.pp_schedule, batch.micro, p, st.index)
    return inp * (not_first * max(0.0, batch.micro - in_flight) + not_last * batch.micro)


def _stage_outputs(
    spec: ModelSpec, st: Stage, layout: Layout, w: Workload, batch: Batch, d: mem.Dtypes, inp: float
) -> tuple[float, float, float]:
    """Bytes of the stage outputs torch's ``PipelineStage`` holds: ``(when backward starts, at a later
    micro-batch's backward, after the last backward)``.

    Every local stage keeps the output of each in-flight micro-batch in its ``fwd_cache`` until that micro-batch's
    backward (the residual stream for a stage that is not the last; under full checkpointing no layer of the stage
    saves its own last output); on the last stage that output is the logits. With ``return_outputs=True``
    (:attr:`Workload.pp_return_outputs`: torch's default, torchtitan's runs) the last stage also appends every
    micro-batch's logits to ``output_chunks`` to merge them for ``step()``'s return value: they stay until the
    next step's ``clear_runtime_states``, through the optimizer step. paratrain's pipeline passes
    ``return_outputs=False`` and keeps none (the loss's log-softmax is a separate fp32 tensor either way)."""
    if layout.pp == 1 or spec.shape is None:
        return 0.0, 0.0, 0.0
    p, m = layout.pp, batch.micro
    v = act.VIRTUAL_STAGES if w.pp_schedule == "interleaved-1f1b" else 1
    holds_last = st.index == p - 1
    not_last = v - (1 if holds_last else 0)
    k = act.in_flight(w.pp_schedule, m, p, st.index)
    later_k = k - 1 if k >= m else k  # a pipeline that ran every forward first holds one fewer by then
    lp = w.loss_parallel and layout.tp > 1
    logits = batch.seq_len * batch.size * spec.shape.vocab_size * d.activation / (layout.tp if lp else 1)
    first_logits = (m if w.pp_schedule == "gpipe" else 1) * logits if holds_last else 0.0
    if not w.pp_return_outputs:  # only the in-flight micro-batches' logits, in fwd_cache until their backward
        return k * not_last * inp + first_logits, later_k * not_last * inp + first_logits, 0.0
    kept = m * logits if holds_last else 0.0
    return k * not_last * inp + first_logits, later_k * not_last * inp + kept, kept


def _shards_accumulated(sharding: str, layout: Layout, w: Workload) -> bool:
    """FSDP reduce-scatters on every accumulation micro-step (``--shard-accumulated-grads``; not under a
    pipeline, whose schedule synchronises on its last micro-batch)."""
    return w.shard_accumulated_grads and sharding == "full" and layout.pp == 1


def _unit_accumulation(sharding: str, layout: Layout, w: Workload, batch: Batch) -> str:
    """:attr:`~paratrain.plan.peak.StepShape.unit_accumulation` of this layout."""
    if sharding != "full" or layout.pp > 1 or batch.accum == 1:
        return ""
    return "sharded" if _shards_accumulated(sharding, layout, w) else "unsharded"


def _accumulation(
    psi: float,
    grad_bytes: float,
    activations: float,
    batch: Batch,
    layout: Layout,
    schedule: str,
    stage: int,
) -> tuple[float, float]:
    """``StepShape``'s accumulated-gradient moment: the local gradients (unsharded: accumulation runs
    without synchronisation) and the activations saved when a later backward starts (0, 0: none)."""
    pipelined = layout.pp > 1 and batch.micro > 1
    if batch.accum == 1 and not pipelined:
        return 0.0, 0.0
    later = activations
    if pipelined:
        k = act.in_flight(schedule, batch.micro, layout.pp, stage)
        if k >= batch.micro:  # every forward ran before the first backward (GPipe, or m <= stages ahead)
            later = activations * (k - 1) / k
    return psi * grad_bytes, later


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a layout: its index, layer groups and parameters on this rank."""

    index: int
    groups: list[ParamGroup]
    first: bool
    last: bool
    root: ParamGroup
    psi: float


def stage_of(spec: ModelSpec, t: int, i: int, groups: list[ParamGroup], first: bool, last: bool) -> Stage:
    root = (spec.first if first else ParamGroup()) + (spec.last if last else ParamGroup())
    psi = sum(g.per_rank(t) for g in groups) + root.per_rank(t)
    return Stage(i, groups, first, last, root, psi)


def _transformer_activations(
    spec: ModelSpec, st: Stage, batch: Batch, layout: Layout, w: Workload, d: mem.Dtypes
) -> tuple[float, float, dict[str, Any]]:
    """``(Korthikanti's reference, the activations the peak uses, the StepShape fields of the layers)`` of a
    transformer stage: paratrain's own Llama op by op (plan/implementation.py), Korthikanti's figure otherwise."""
    assert spec.shape is not None
    sh, s_, b_, t = spec.shape, batch.seq_len, batch.size, layout.tp
    ac = str(w.activation_checkpointing)
    mode, every = act.checkpoint_policy(ac)
    sp = w.sequence_parallel and t > 1
    lp = w.loss_parallel and t > 1
    layers = len(st.groups)
    micro = act.in_flight(w.pp_schedule, batch.micro, layout.pp, st.index)
    reference = act.stage(
        sh, layers=layers, first=st.first, last=st.last, s=s_, b=b_, t=t, sp=sp, attention=w.attention,
        act_bytes=d.activation, checkpointing=ac, micro=micro,
    )  # fmt: skip
    if sh.arch == "llama":  # paratrain's own Llama: what its ops keep (plan/implementation.py)
        activations = impl.stage(
            sh, layers=layers, first=st.first, last=st.last, s=s_, b=b_, t=t, sp=sp, loss_parallel=lp,
            attention=w.attention, act_bytes=d.activation, checkpointing=ac, micro=micro, compiled_loss=w.compile_loss,
        )  # fmt: skip
        per_layer = impl.layer(sh, s_, b_, t, sp, w.attention, d.activation)
        selective = impl.layer_selective(sh, s_, b_, t, sp, d.activation)
        cl = d.activation if w.compile_loss else 0
        loss_grad = impl.loss_grad(sh, s_, b_, t, lp, cl) if st.last else 0.0
        before = micro * impl.first_extra(sh, s_, b_) if st.first else 0.0
        released = impl.last_extra(sh, s_, b_, t, sp, lp, d.activation, w.compile_loss) if st.last else 0.0
    else:  # no GPT implementation in paratrain: Korthikanti's figure is the only one
        activations = reference
        per_layer = act.layer(sh, s_, b_, t, sp, w.attention, d.activation)
        selective = act.llama_layer_selective(sh, s_, b_, t, sp, d.activation)
        loss_grad = before = 0.0
        released = act.last_extra(sh, s_, b_, t, sp, d.activation) if st.last else 0.0
    inp = s_ * b_ * sh.dim * d.activation / (t if sp else 1)
    if spec.moe is not None:  # routed rows and experts in place of the dense MLP, averaged over the layers
        from paratrain.plan.moe import moe_activation_delta

        m = spec.moe
        one = moe_activation_delta(
            replace(m, moe_layers=1), s_, b_ / t, w.moe_ep, w.moe_overload, d.activation
        )
        extra = one * m.moe_layers / sh.n_layers
        kept_extra, working_extra = act.kept_layers(mode, every, layers, extra, 0.0, extra)
        activations += micro * kept_extra + working_extra
        per_layer, selective = per_layer + extra, selective + extra
    working = act.kept_layers(mode, every, layers, per_layer, inp, selective)[1]
    activations -= working  # live only while a layer recomputes: its own moment (plan/peak.py)
    kept = [act.kept_layers(mode, every, 1, per_layer, inp, selective)[0]] * layers
    if mode == "every":  # the N-th, 2N-th, ... layers of the stage are checkpointed
        kept = [inp if (j + 1) % every == 0 else per_layer for j in range(layers)]
    shape_kw = {"unit_activations": tuple(micro * k for k in kept), "before_units": before,
                "unit_input_grad": inp, "loss_grad": loss_grad, "batch": 2 * s_ * b_ * impl.INT64,
                "recompute_working": working, "released_before_recompute": micro * released,
                "later_released": released}  # fmt: skip
    return reference, activations, shape_kw


def stage_peak(
    spec: ModelSpec,
    sharding: str,
    layout: Layout,
    w: Workload,
    cluster: Cluster,
    batch: Batch,
    d: mem.Dtypes,
    st: Stage,
    states: mem.States,
) -> tuple[pk.Peak, float, float]:
    """``(the stage's peak moment, its activations, Korthikanti's reference)`` (plan/peak.py)."""  # fmt: skip
    t, n = layout.tp, layout.dp_shard
    if spec.states_only:
        moment = pk.Peak("model states only", {"params": states.params, "grads": states.grads,
                                               "optimizer": states.optimizer})  # fmt: skip
        return moment, 0.0, 0.0
    reference = activations = 0.0
    shape_kw: dict[str, Any] = {}
    if spec.shape is not None:
        reference, activations, shape_kw = _transformer_activations(spec, st, batch, layout, w, d)
    elif spec.profile is not None:
        mode = act.checkpoint_policy(str(w.activation_checkpointing))[0]
        reference = activations = act.module(spec.profile, batch.size, d.activation, mode != "none")
        prof, scale = spec.profile, batch.size * d.activation / 4
        shape_kw = {"unit_activations": tuple(x * scale for x in prof.blocks_saved),
                    "unit_input_grad": max(prof.blocks_input, default=0.0) * scale,
                    "batch": prof.batch * batch.size}  # fmt: skip
    largest = spec.largest_tensor.per_rank(t) / (n if sharding != "none" else 1)
    psi = st.psi
    unit_bytes, gathered = _gathered_bytes(spec, st, t, w, d)
    buffers, outputs = 0.0, (0.0, 0.0, 0.0)
    if spec.shape is not None:
        sp_split = t if w.sequence_parallel and t > 1 else 1
        inp = batch.seq_len * batch.size * spec.shape.dim * d.activation / sp_split
        buffers = _pipeline_buffers(st, layout, w, batch, inp)
        outputs = _stage_outputs(spec, st, layout, w, batch, d, inp)
    acc = _accumulation(psi, _reduced_grad_bytes(sharding, w, d), activations, batch, layout,
                        w.pp_schedule, st.index)  # fmt: skip
    # with every micro-step reduced, a later micro-step holds the gradient shard, not the whole gradients
    if acc[0] and _shards_accumulated(sharding, layout, w):
        acc = (0.0 if w.offload else states.grads, acc[1])
    units, root, kept = tuple(g.per_rank(t) for g in st.groups), st.root.per_rank(t), 0.0
    if spec.embedding_units and sharding == "full" and layout.pp == 1 and t == 1:
        # zero3/hsdp of an HF model: the embedding and the final norm + head are units, the root holds nothing;
        # the head's unit stays gathered from the end of forward to its backward
        units, root = (spec.first.per_rank(t), *units, spec.last.per_rank(t)), 0.0
        kept = spec.last.per_rank(t) * d.compute
        if "unit_activations" in shape_kw:
            shape_kw["unit_activations"] = (0.0, *shape_kw["unit_activations"])
    moment = pk.peak(pk.StepShape(
        states=states, on_device=not w.offload, activations=activations, psi=psi, sharding=sharding, n=n,
        dp=layout.dp, d=d, units=units, root=root, kept_gathered=kept,
        largest_tensor=largest, optimizer=w.optimizer, cpu=cluster.on_cpu,
        optimizer_kernel=pk.optimizer_kernel(w.optimizer, w.optimizer_implementation, cluster.on_cpu),
        bucket_bytes=w.bucket_cap_mb * 2**20, gradient_as_bucket_view=w.gradient_as_bucket_view,
        cast_copies=2 * psi if w.precision in ("bf16", "fp16") and sharding != "full" else 0.0,
        accumulated_grads=acc[0], later_activations=acc[1], unit_accumulation=_unit_accumulation(sharding, layout, w, batch),
        later_unsharded_params=psi * gathered if sharding == "full" and n > 1 and acc[0] and layout.pp > 1 else 0.0,
        unit_param_bytes=unit_bytes, pipeline_buffers=buffers, stage_outputs=outputs[0],
        later_stage_outputs=outputs[1], kept_stage_outputs=outputs[2],
        **shape_kw,
    ))  # fmt: skip
    return moment, activations, reference


def stage_time(
    spec: ModelSpec,
    sharding: str,
    layout: Layout,
    w: Workload,
    cluster: Cluster,
    batch: Batch,
    d: mem.Dtypes,
    st: Stage,
) -> tuple[float, dict[str, Any]]:
    """``(the stage's step time, its communication bytes and time breakdown)`` (plan/comm.py, plan/time.py)."""  # fmt: skip
    t = layout.tp
    mode, every = act.checkpoint_policy(str(w.activation_checkpointing))
    sp = w.sequence_parallel and t > 1
    layers = len(st.groups)
    hidden = batch.seq_len * batch.size * spec.shape.dim * d.activation if spec.shape else 0.0
    ops = step_ops(
        layout=layout, sharding=sharding, psi=st.psi, grad_bytes=_reduced_grad_bytes(sharding, w, d),
        param_bytes=d.param, compute_bytes=_gathered_bytes(spec, st, t, w, d)[1], units=layers + 1,
        bucket_bytes=w.bucket_cap_mb * 2**20, accum=batch.accum, tokens_bytes=hidden, layers=layers,
        sync_every_accum=_shards_accumulated(sharding, layout, w), passes=batch.accum * batch.micro, sequence_parallel=sp, recompute=tp_rerun(mode, every), first=st.first,
        last=st.last, chunks=act.VIRTUAL_STAGES if w.pp_schedule == "interleaved-1f1b" else 1,
    )  # fmt: skip
    redo = recompute_fraction(spec, mode, every)
    samples = batch.global_batch / layout.dp
    flops = stage_flops_per_sample(spec, batch.seq_len, layers, st.last, redo) * samples / t
    linear = stage_linear_flops_per_sample(spec, batch.seq_len, layers, redo) * samples / t
    attention = stage_attention_flops_per_sample(spec, batch.seq_len, layers, redo) * samples / t
    slow = compute_slowdown(spec, t, batch.size * batch.seq_len, cluster.matmul_knee)
    wide = cluster.gpu_flops * cluster.efficiency  # a wide 16-bit matmul's FLOP/s
    # --fp8: the layers' linear matmuls at the fp8 peak, the rest at the 16-bit one
    linear_peak = cluster.fp8_flops * cluster.efficiency if w.fp8 else wide
    seconds = (linear * slow["linear"] / linear_peak + attention * slow["attention"] / wide
               + (flops - linear - attention) * slow["rest"] / wide)  # fmt: skip
    time_ = step_time(seconds, redo, [(op, link_for(layout, op.axis, cluster)) for op in ops],
                      micro=batch.micro, accum=batch.accum, pp=layout.pp, schedule=w.pp_schedule)  # fmt: skip
    comm: dict[str, int] = {}
    for op in ops:
        comm[op.key] = comm.get(op.key, 0) + round(op.sent)
    comm["total"] = sum(comm.values())
    timing = time_.to_dict()
    if cluster.matmul_knee:  # the fraction of the 16-bit peak the compute achieves under the width model
        timing["compute_efficiency"] = flops / (cluster.gpu_flops * seconds) if seconds else 0.0
    return time_.total, {"comm_bytes_per_rank_per_step": comm, "time_s": timing}
