"""``plan()``: bytes per rank, communication and step time of a model × layout × batch × cluster.

Pure computation: no process group, no GPU. The result is the JSON of ``paratrain plan --json``::

    {"model": ..., "num_params": ..., "cluster": {...},
     "plans": [{"strategy": "zero2", "layout": {"dp_replicate", "dp_shard", "tp", "pp"},
                "bytes_per_rank": {"params", "grads", "optimizer", "activations", "buffers", "peak"},
                "model_state_bytes_per_rank": .., "fits": true,
                "comm_bytes_per_rank_per_step": {"<axis>.<collective>": .., "total": ..},
                "step_time_s": .., "mfu": .., ...}, ...]}

Each plan also carries ``activation_checkpointing``, the batch it assumed (``global_batch_size``,
``micro_batch_size``, ``microbatches``, ``grad_accum``, ``seq_len``), ``time_s`` (compute, bubble,
exposed and total communication), ``stage`` (the pipeline stage the bytes are for: the one with the
highest peak) and ``reason`` (filled in by :func:`paratrain.plan.recommend.recommend`).
``model_state_bytes_per_rank`` is what ``paratrain train --json`` measures under the same name: parameters
+ gradients + optimizer state held at rest, wherever they live.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan import activations as act
from paratrain.plan import implementation as impl
from paratrain.plan import layout as lay
from paratrain.plan import memory as mem
from paratrain.plan import peak as pk
from paratrain.plan.comm import link_for, step_ops
from paratrain.plan.layout import Layout
from paratrain.plan.model import ModelSpec, ParamGroup
from paratrain.plan.time import (
    model_flops_per_sample,
    recompute_fraction,
    stage_flops_per_sample,
    step_time,
    tp_rerun,
)
from paratrain.spec.hardware import Cluster

RESERVED_OVER_ALLOCATED = 1.12
"""The CUDA caching allocator's reserved bytes over its allocated peak, measured on paratrain's GPU runs
(``benchmarks/results/plan_vs_cuda_h200.json``, llama-small on one H200: 1.09 under ddp/zero1/zero2, 1.16 under
zero3, whose all-gathers and frees fragment more): ``peak_reserved`` = allocated peak × 1.12. Peers report
reserved (torchtitan's "Memory (GiB)" is ``torch.cuda.max_memory_reserved``); ``fits`` is decided on the
allocated peak."""

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
    precision: str = "fp32"
    offload: bool = False
    attention: str = "sdpa"
    sequence_parallel: bool = True
    loss_parallel: bool = False
    """TP: keep the logits vocabulary-sharded through the loss (``--set strategy.loss_parallel=true`` in train);
    off, paratrain's output layer gathers them to the full vocabulary on every TP rank."""
    pp_schedule: str = "1f1b"
    fp8_all_gather: bool = False
    """FSDP all-gathers the layers' linear weights in float8 (torchao's ``Float8Linear`` with
    ``enable_fsdp_float8_all_gather``, torchtitan's ``[float8]`` setting): the unsharded weights (and the
    all-gather messages) are 1 byte per element instead of the compute dtype's 2; the embedding and output
    layer stay 16-bit. Time still uses the 16-bit peak (fp8 matmuls are not modelled)."""
    reduce_fp32: bool = False
    """FSDP under 16-bit compute: reduce-scatter the gradients, and accumulate them unsharded between
    micro-batches, in fp32 (``MixedPrecisionPolicy(reduce_dtype=float32)``, torchtitan's
    ``mixed_precision_reduce`` default; FSDP2 upcasts the accumulated gradient to the reduce dtype). paratrain's
    own FSDP reduces in the compute dtype (``--reduce-fp32`` off)."""
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False

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
class _Batch:
    global_batch: int
    seq_len: int
    accum: int
    micro: int  # pipeline micro-batches per accumulation step
    size: int  # samples per micro-batch on one rank


def _batch(spec: ModelSpec, layout: Layout, w: Workload, gpus: int) -> _Batch:
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
    return _Batch(b, seq, w.grad_accum, m, size)


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


def _gathered_bytes(spec: ModelSpec, st: _Stage, t: int, w: Workload, d: mem.Dtypes) -> tuple[float, float]:
    """``(bytes per element of an all-gathered layer, of the stage's gathered parameters on average)``: the
    compute dtype, or 1 for the layers' weights with ``--fp8-all-gather`` (the norms' few weights included)."""
    if not w.fp8_all_gather:
        return float(d.compute), float(d.compute)
    unit, root = 1.0, st.root.per_rank(t)
    return unit, ((st.psi - root) * unit + root * d.compute) / st.psi if st.psi else float(d.compute)


def _pipeline_buffers(st: _Stage, layout: Layout, w: Workload, batch: _Batch, inp: float) -> float:
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


def _accumulation(
    psi: float,
    grad_bytes: float,
    activations: float,
    batch: _Batch,
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
class _Stage:
    """One pipeline stage of a layout: its index, layer groups and parameters on this rank."""

    index: int
    groups: list[ParamGroup]
    first: bool
    last: bool
    root: ParamGroup
    psi: float


def _stage_of(spec: ModelSpec, t: int, i: int, groups: list[ParamGroup], first: bool, last: bool) -> _Stage:
    root = (spec.first if first else ParamGroup()) + (spec.last if last else ParamGroup())
    psi = sum(g.per_rank(t) for g in groups) + root.per_rank(t)
    return _Stage(i, groups, first, last, root, psi)


def _transformer_activations(
    spec: ModelSpec, st: _Stage, batch: _Batch, layout: Layout, w: Workload, d: mem.Dtypes
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
            attention=w.attention, act_bytes=d.activation, checkpointing=ac, micro=micro,
        )  # fmt: skip
        per_layer = impl.layer(sh, s_, b_, t, sp, w.attention, d.activation)
        selective = impl.layer_selective(sh, s_, b_, t, sp, d.activation)
        loss_grad = impl.loss_grad(sh, s_, b_, t, lp) if st.last else 0.0
        before = micro * impl.first_extra(sh, s_, b_) if st.first else 0.0
        released = impl.last_extra(sh, s_, b_, t, sp, lp, d.activation) if st.last else 0.0
    else:  # no GPT implementation in paratrain: Korthikanti's figure is the only one
        activations = reference
        per_layer = act.layer(sh, s_, b_, t, sp, w.attention, d.activation)
        selective = act.llama_layer_selective(sh, s_, b_, t, sp, d.activation)
        loss_grad = before = 0.0
        released = act.last_extra(sh, s_, b_, t, sp, d.activation) if st.last else 0.0
    inp = s_ * b_ * sh.dim * d.activation / (t if sp else 1)
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


def _stage_peak(
    spec: ModelSpec,
    sharding: str,
    layout: Layout,
    w: Workload,
    cluster: Cluster,
    batch: _Batch,
    d: mem.Dtypes,
    st: _Stage,
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
    buffers = 0.0
    if spec.shape is not None:
        inp = batch.seq_len * batch.size * spec.shape.dim * d.activation
        buffers = _pipeline_buffers(st, layout, w, batch, inp / (t if w.sequence_parallel and t > 1 else 1))
    acc = _accumulation(psi, _reduced_grad_bytes(sharding, w, d), activations, batch, layout,
                        w.pp_schedule, st.index)  # fmt: skip
    moment = pk.peak(pk.StepShape(
        states=states, on_device=not w.offload, activations=activations, psi=psi, sharding=sharding, n=n,
        dp=layout.dp, d=d, units=tuple(g.per_rank(t) for g in st.groups), root=st.root.per_rank(t),
        largest_tensor=largest, optimizer=w.optimizer, cpu=cluster.on_cpu,
        bucket_bytes=w.bucket_cap_mb * 2**20, gradient_as_bucket_view=w.gradient_as_bucket_view,
        cast_copies=2 * psi if w.precision in ("bf16", "fp16") and sharding != "full" else 0.0,
        accumulated_grads=acc[0], later_activations=acc[1],
        later_unsharded_params=psi * gathered if sharding == "full" and n > 1 and acc[0] and layout.pp > 1 else 0.0,
        unit_param_bytes=unit_bytes, pipeline_buffers=buffers,
        **shape_kw,
    ))  # fmt: skip
    return moment, activations, reference


def _stage_time(
    spec: ModelSpec,
    sharding: str,
    layout: Layout,
    w: Workload,
    cluster: Cluster,
    batch: _Batch,
    d: mem.Dtypes,
    st: _Stage,
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
        passes=batch.accum * batch.micro, sequence_parallel=sp, recompute=tp_rerun(mode, every), first=st.first,
        last=st.last, chunks=act.VIRTUAL_STAGES if w.pp_schedule == "interleaved-1f1b" else 1,
    )  # fmt: skip
    redo = recompute_fraction(spec, mode, every)
    samples = batch.global_batch / layout.dp
    flops = stage_flops_per_sample(spec, batch.seq_len, layers, st.last, redo) * samples / t
    rate = cluster.gpu_flops * cluster.efficiency
    time_ = step_time(flops / rate, redo, [(op, link_for(layout, op.axis, cluster)) for op in ops],
                      micro=batch.micro, accum=batch.accum, pp=layout.pp, schedule=w.pp_schedule)  # fmt: skip
    comm: dict[str, int] = {}
    for op in ops:
        comm[op.key] = comm.get(op.key, 0) + round(op.sent)
    comm["total"] = sum(comm.values())
    return time_.total, {"comm_bytes_per_rank_per_step": comm, "time_s": time_.to_dict()}


def _memory_row(st: _Stage, states: mem.States, moment: pk.Peak, activations: float, reference: float,
                cluster: Cluster) -> dict[str, Any]:  # fmt: skip
    """The bytes part of a stage's plan: states, activations, buffers, the peak and its moment."""
    counted = ("params", "grads", "optimizer", "activations")
    buffers = sum(v for k, v in moment.terms.items() if k not in counted)
    peak = moment.total
    return {
        "stage": st.index,
        "bytes_per_rank": {
            "params": round(states.params), "grads": round(states.grads),
            "optimizer": round(states.optimizer), "activations": round(activations),
            "buffers": round(buffers), "peak": round(peak),
            "peak_reserved": round(peak * (1.0 if cluster.on_cpu else RESERVED_OVER_ALLOCATED)),
        },
        "model_state_bytes_per_rank": round(states.total),
        "fits": peak <= cluster.gpu_mem_bytes,
        "peak_moment": {"phase": moment.phase, "terms": {k: round(v) for k, v in moment.terms.items()}},
        "activations_korthikanti": round(reference),
    }  # fmt: skip


def evaluate(
    spec: ModelSpec, strategy: str, sharding: str, layout: Layout, w: Workload, cluster: Cluster
) -> dict[str, Any]:
    """One plan (the JSON contract's ``plans`` item) for a validated layout: the bytes of the stage with the
    highest peak, the time of the slowest stage."""
    batch = _batch(spec, layout, w, cluster.gpus)
    d = mem.dtypes(w.precision, w.optimizer, w.momentum)
    best: dict[str, Any] | None = None
    slowest: tuple[float, dict[str, Any]] | None = None
    for i, groups, first, last in stages(spec, layout.pp):
        st = _stage_of(spec, layout.tp, i, groups, first, last)
        states = mem.model_states(st.psi, layout.dp_shard, sharding, d)
        moment, activations, reference = _stage_peak(spec, sharding, layout, w, cluster, batch, d, st, states)
        row = _memory_row(st, states, moment, activations, reference, cluster)
        if best is None or row["bytes_per_rank"]["peak"] > best["bytes_per_rank"]["peak"]:
            best = row
        total, timing = _stage_time(spec, sharding, layout, w, cluster, batch, d, st)
        if slowest is None or total > slowest[0]:
            slowest = (total, timing)
    assert best is not None and slowest is not None
    step = slowest[0]
    useful = model_flops_per_sample(spec, batch.seq_len) * batch.global_batch
    return {
        "strategy": strategy,
        "layout": layout.to_dict(),
        "activation_checkpointing": str(w.activation_checkpointing),
        "pp_schedule": w.pp_schedule if layout.pp > 1 else None,
        **{k: best[k] for k in ("bytes_per_rank", "model_state_bytes_per_rank", "fits", "peak_moment",
                                "activations_korthikanti")},
        **slowest[1],
        "step_time_s": step,
        "mfu": useful / (step * cluster.gpus * cluster.gpu_flops) if step > 0 else None,
        "stage": best["stage"],
        "global_batch_size": batch.global_batch,
        "micro_batch_size": batch.size,
        "microbatches": batch.micro,
        "grad_accum": batch.accum,
        "seq_len": batch.seq_len,
        "reason": "",
    }  # fmt: skip


def header(spec: ModelSpec, cluster: Cluster, w: Workload) -> dict[str, Any]:
    return {"model": spec.name, "num_params": spec.num_params, "cluster": cluster.to_dict(),
            "precision": w.precision, "optimizer": w.optimizer}  # fmt: skip


def default_layouts(spec: ModelSpec, cluster: Cluster) -> list[tuple[str, str, Layout]]:
    """ddp, zero1, zero2, zero3 and, for a transformer, the valid tp / pp / tp×pp layouts (pp up to 8)."""
    g = cluster.gpus
    out: list[tuple[str, str, Layout]] = [(name, lay.STRATEGIES[name].sharding, Layout.of(dp_replicate=g) if name == "ddp" else Layout.of(dp_shard=g))
           for name in lay.DATA_PARALLEL]  # fmt: skip
    sh = spec.shape
    if sh is None:
        return out
    tps = [t for t in lay.valid_tp(sh, min(cluster.gpus_per_node, g)) if t > 1 and g % t == 0]
    if spec.moe is not None:  # paratrain's TP plan has no MoE layers: experts are split by ep instead
        tps = []
    pps = [p for p in (2, 4, 8) if g % p == 0 and p <= sh.n_layers]
    pairs = [(t, 1) for t in tps] + [(1, p) for p in pps]
    pairs += [(tps[-1], p) for p in pps if tps and g % (tps[-1] * p) == 0]
    for t, p in pairs:
        layout = Layout.of(dp_shard=g // (t * p), tp=t, pp=p)
        name = lay.name_for(layout)
        out.append((name, lay.STRATEGIES[name].sharding if layout.dp == 1 else "full", layout))
    return out


def plan(
    spec: ModelSpec,
    cluster: Cluster,
    workload: Workload | None = None,
    strategy: str | None = None,
    *,
    tp: int | None = None,
    pp: int | None = None,
    dp_shard: int | None = None,
    dp_replicate: int | None = None,
    ep: int | None = None,
    moe_overload: float = 1.0,
) -> dict[str, Any]:
    """The plan of one strategy / layout (``strategy`` or any degree given), else of :func:`default_layouts`.

    Raises :class:`ConfigError` for degrees that do not multiply to ``cluster.gpus``, a tp that does not
    divide the heads, a batch that does not split, an unknown strategy, and whatever ``paratrain train`` refuses
    for the named strategy before launch (with train's message: a tensor- or pipeline-parallel flag of a
    strategy without that axis, ``--offload`` outside zero3/hsdp, ...).
    """
    w = workload or Workload()
    from paratrain.plan.moe import EP_STRATEGIES

    if strategy in EP_STRATEGIES or ep is not None:  # expert parallelism: plan/moe.py
        if strategy not in EP_STRATEGIES:
            raise ConfigError(f"--ep {ep} splits the experts of an MoE model: use --strategy ep or fsdp+ep.")
        out = header(spec, cluster, w)
        out["plans"] = ep_plans(spec, cluster, w, strategy, ep, moe_overload, dp_shard, dp_replicate)
        return out
    if strategy is not None or any(v is not None for v in (tp, pp, dp_shard, dp_replicate)):
        options = {"microbatches": w.microbatches, "pp_schedule": w.pp_schedule, "offload": w.offload,
                   "sequence_parallel": w.sequence_parallel, "loss_parallel": w.loss_parallel}  # fmt: skip
        chosen = [lay.resolve(strategy, cluster.gpus, shape=spec.shape, gpus_per_node=cluster.gpus_per_node, tp=tp,
                              pp=pp, dp_shard=dp_shard, dp_replicate=dp_replicate, model=spec.name,
                              options=options)]  # fmt: skip
    else:
        chosen = default_layouts(spec, cluster)
        if w.offload:
            chosen = [c for c in chosen if c[1] == "full"]
    if spec.moe is not None and any(layout.tp > 1 for _, _, layout in chosen):
        raise ConfigError(
            f"model {spec.name!r} has MoE layers, which paratrain's tensor-parallel plan does not split; use "
            "--strategy ep or fsdp+ep (experts over an ep axis), or a strategy without tp."
        )
    out = header(spec, cluster, w)
    out["plans"] = [evaluate(spec, name, sharding, layout, w, cluster) for name, sharding, layout in chosen]
    for (name, sharding, layout), p in zip(chosen, out["plans"], strict=True):
        p["advice"] = [] if p["fits"] else advice(spec, name, sharding, layout, w, cluster)
    if strategy is None and spec.moe is not None and not w.offload:  # an MoE model: ep and fsdp+ep too
        out["plans"] += ep_plans(spec, cluster, w, None, None, moe_overload)
    return out


PEER_DEFAULTS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("--loss-parallel", {"loss_parallel": True}, "torchtitan computes the loss on vocabulary-sharded logits with "
     "TP by default; without it every TP rank holds the full logits and their fp32 log-softmax"),
    ("--activation-checkpointing selective", {"activation_checkpointing": "selective"}, "torchtitan's default: "
     "keep matmul and attention outputs, recompute the cheap ops"),
    ("--activation-checkpointing full", {"activation_checkpointing": "full"}, "each block keeps only its input"),
)  # fmt: skip
"""Options the peers turn on by default that a plan that does not fit is tried with (:func:`advice`). FSDP's
``reshard_after_forward=False`` (torchtitan's choice under PP) costs memory rather than saving it, and
paratrain always reshards after forward: nothing to advise there."""


def advice(
    spec: ModelSpec, strategy: str, sharding: str, layout: Layout, w: Workload, cluster: Cluster
) -> list[str]:
    """For a plan that does not fit: each single option the peers use by default under which it fits, with its
    peak (the plan says why it does not fit and what would make it)."""
    out: list[str] = []
    for flag, change, why in PEER_DEFAULTS:
        if all(getattr(w, k) == v for k, v in change.items()):
            continue
        if "loss_parallel" in change and layout.tp == 1:
            continue
        if "activation_checkpointing" in change and w.activation_checkpointing != "none":
            continue
        try:
            p = evaluate(spec, strategy, sharding, layout, replace(w, **change), cluster)
        except ConfigError:
            continue
        if p["fits"]:
            peak = p["bytes_per_rank"]["peak"]
            out.append(
                f"fits with {flag}: peak {peak / 1e9:,.1f} GB of {cluster.gpu_mem_bytes / 1e9:,.0f} ({why})"
            )
    return out


def with_defaults(w: Workload, cluster: Cluster, precision: str | None) -> Workload:
    """``precision`` None: fp32 on ``cpu-local`` (what paratrain runs on CPU), bf16 on a GPU cluster."""
    if precision is None:
        precision = "fp32" if cluster.name.startswith("cpu-local") else "bf16"
    return replace(w, precision=precision)


def ep_plans(spec: Any, cluster: Any, w: Any, strategy: str | None, ep: int | None, overload: float,
             dp_shard: int | None = None, dp_replicate: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The plans of ``strategy`` (``ep``/``fsdp+ep``; ``None``: both, at their default degrees) for ``spec``."""
    from paratrain.plan import memory as mem
    from paratrain.plan.moe import EP_STRATEGIES, MoEShape, apply_expert_parallel, check_ep

    moe: MoEShape | None = getattr(spec, "moe", None)
    names = [strategy] if strategy is not None else list(EP_STRATEGIES)
    out = []
    for name in names:
        degree = ep if ep is not None else (cluster.gpus if name == "ep" else 2)
        if strategy is None and (
            moe is None or cluster.gpus % degree or moe.n_experts % degree or degree < 2
        ):
            continue  # a default that does not apply to this model or cluster
        if strategy is not None and degree < 2 and cluster.gpus > 1:
            raise ConfigError(f"strategy {name!r} splits the experts over an ep axis; give --ep 2 or more.")
        check_ep(moe, degree, cluster.gpus, spec.name)
        assert moe is not None
        base = plan(spec, cluster, w, EP_STRATEGIES[name][0], dp_shard=dp_shard, dp_replicate=dp_replicate)
        intra = degree <= cluster.gpus_per_node
        alpha = cluster.intra_latency if intra else cluster.inter_latency
        beta = 1 / (cluster.intra_bw if intra else cluster.inter_bw)
        d = mem.dtypes(w.precision, w.optimizer, w.momentum)
        out.append(apply_expert_parallel(base["plans"][0], name, moe, degree, spec.num_params, overload, d,
                                         alpha, beta, cluster.gpu_mem_bytes))  # fmt: skip
    return out
