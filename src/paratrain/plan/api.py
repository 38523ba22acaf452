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

from dataclasses import replace
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan import layout as lay
from paratrain.plan import memory as mem
from paratrain.plan import peak as pk
from paratrain.plan.layout import Layout
from paratrain.plan.model import ModelSpec
from paratrain.plan.stage import (
    Stage,
    Workload,
    batch_of,
    stage_of,
    stage_peak,
    stage_time,
    stages,
)
from paratrain.plan.time import model_flops_per_sample
from paratrain.spec.capabilities import hf_no_ep, hf_no_pp, hf_no_tp
from paratrain.spec.hardware import Cluster

RESERVED_OVER_ALLOCATED = {"full": 1.16, "other": 1.09}
"""The CUDA caching allocator's reserved bytes over its allocated peak, as measured on paratrain's GPU runs
(``benchmarks/results/plan_vs_cuda_h200.json``, llama-small on one H200): 1.16 when parameters are sharded
and gathered layer by layer (``sharding == "full"``: zero3, hsdp and every ``fsdp+`` layout, whose
all-gathers and frees fragment the cache), 1.09 otherwise (ddp, dp, zero1, zero2, tp and pp alone).
``peak_reserved`` = allocated peak × that ratio. Peers report reserved (torchtitan's "Memory (GiB)" is
``torch.cuda.max_memory_reserved``); ``fits`` is decided on the allocated peak."""


def reserved_over_allocated(sharding: str, cluster: Cluster) -> float:
    """The ratio ``peak_reserved / peak`` for a plan (1 on CPU, where there is no caching allocator)."""
    if cluster.on_cpu:
        return 1.0
    return RESERVED_OVER_ALLOCATED["full" if sharding == "full" else "other"]


def _memory_row(st: Stage, states: mem.States, moment: pk.Peak, activations: float, reference: float,
                cluster: Cluster, sharding: str) -> dict[str, Any]:  # fmt: skip
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
            "peak_reserved": round(peak * reserved_over_allocated(sharding, cluster)),
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
    batch = batch_of(spec, layout, w, cluster.gpus)
    d = mem.dtypes(w.precision, w.optimizer, w.momentum)
    best: dict[str, Any] | None = None
    slowest: tuple[float, dict[str, Any]] | None = None
    for i, groups, first, last in stages(spec, layout.pp):
        st = stage_of(spec, layout.tp, i, groups, first, last)
        states = mem.model_states(st.psi, layout.dp_shard, sharding, d)
        moment, activations, reference = stage_peak(spec, sharding, layout, w, cluster, batch, d, st, states)
        row = _memory_row(st, states, moment, activations, reference, cluster, sharding)
        if best is None or row["bytes_per_rank"]["peak"] > best["bytes_per_rank"]["peak"]:
            best = row
        total, timing = stage_time(spec, sharding, layout, w, cluster, batch, d, st)
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


def _check_splits(spec: ModelSpec, chosen: list[tuple[str, str, Layout]]) -> None:
    """Refuse a tensor- or pipeline-parallel layout of a model paratrain cannot split that way, in the words of
    ``paratrain train``'s refusal."""
    arch = spec.arch or spec.name
    for _, _, layout in chosen:
        if layout.tp > 1 and "tp" not in spec.splits:
            raise ConfigError(hf_no_tp(arch, layout.tp, "pp" in spec.splits))
        if layout.pp > 1 and "pp" not in spec.splits:
            raise ConfigError(hf_no_pp(arch))


def default_layouts(spec: ModelSpec, cluster: Cluster) -> list[tuple[str, str, Layout]]:
    """ddp, zero1, zero2, zero3 and, for a transformer, the valid tp / pp / tp×pp layouts (pp up to 8)."""
    g = cluster.gpus
    out: list[tuple[str, str, Layout]] = [(name, lay.STRATEGIES[name].sharding, Layout.of(dp_replicate=g) if name == "ddp" else Layout.of(dp_shard=g))
           for name in lay.DATA_PARALLEL]  # fmt: skip
    sh = spec.shape
    if sh is None:
        return out
    tps = [t for t in lay.valid_tp(sh, min(cluster.gpus_per_node, g)) if t > 1 and g % t == 0]
    if (
        spec.moe is not None or "tp" not in spec.splits
    ):  # MoE: ep splits the experts; an HF arch without a plan
        tps = []
    pps = [p for p in (2, 4, 8) if g % p == 0 and p <= sh.n_layers and "pp" in spec.splits]
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

    if (strategy in EP_STRATEGIES or ep is not None) and "ep" not in spec.splits:
        raise ConfigError(hf_no_ep(spec.arch or spec.name, ep or 2))
    if strategy in EP_STRATEGIES or ep is not None:  # expert parallelism: plan/moe.py
        if strategy not in EP_STRATEGIES:
            raise ConfigError(
                f"--ep {ep} splits the experts of an MoE model: use --strategy {' or '.join(EP_STRATEGIES)}."
            )
        out = header(spec, cluster, w)
        out["plans"] = ep_plans(spec, cluster, w, strategy, ep, moe_overload, dp_shard, dp_replicate, tp, pp)
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
    _check_splits(spec, chosen)
    if spec.moe is not None and any(layout.tp > 1 for _, _, layout in chosen):
        raise ConfigError(
            f"model {spec.name!r} has MoE layers, whose experts tensor parallelism leaves to an ep axis; use "
            "--strategy fsdp+tp+ep (or ep, fsdp+ep, fsdp+ep+pp), or a strategy without tp."
        )
    out = header(spec, cluster, w)
    out["plans"] = [evaluate(spec, name, sharding, layout, w, cluster) for name, sharding, layout in chosen]
    for (name, sharding, layout), p in zip(chosen, out["plans"], strict=True):
        p["advice"] = [] if p["fits"] else advice(spec, name, sharding, layout, w, cluster)
    if strategy is None and spec.moe is not None and not w.offload and "ep" in spec.splits:  # ep, fsdp+ep too
        out["plans"] += ep_plans(spec, cluster, w, None, None, moe_overload)
    return out


PEER_DEFAULTS: tuple[tuple[str, dict[str, Any], str], ...] = (
    ("--loss-parallel", {"loss_parallel": True}, "torchtitan computes the loss on vocabulary-sharded logits with "
     "TP by default; without it every TP rank holds the full logits and their fp32 log-softmax"),
    ("--activation-checkpointing selective", {"activation_checkpointing": "selective"}, "torchtitan's default: "
     "keep matmul and attention outputs, recompute the cheap ops"),
    ("--activation-checkpointing full", {"activation_checkpointing": "full"}, "each block keeps only its input"),
    ("--shard-accumulated-grads", {"shard_accumulated_grads": True}, "torchtitan and DeepSpeed ZeRO-3 "
     "reduce-scatter on every accumulation micro-step and hold one gradient shard, not the whole gradients"),
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
        if "shard_accumulated_grads" in change and not (
            sharding == "full" and layout.pp == 1 and w.grad_accum > 1
        ):
            continue
        if p := _fitting(spec, strategy, sharding, layout, replace(w, **change), cluster):
            out.append(f"fits with {flag}: {_peak_of(p, cluster)} ({why})")
    if layout.pp > 1 and (fewer := _fewer_microbatches(spec, strategy, sharding, layout, w, cluster)):
        out.append(fewer)
    return out


def _fewer_microbatches(
    spec: ModelSpec, strategy: str, sharding: str, layout: Layout, w: Workload, cluster: Cluster
) -> str | None:
    """A pipeline that does not fit, tried with its micro-batches run in k accumulation steps (``--microbatches
    m/k --grad-accum k``: the same batch and micro-batch size) for the smallest k that fits. torch's
    ``PipelineStage`` allocates a receive buffer per micro-batch of a schedule step (activations in, gradients
    back) and 1F1B keeps up to ``pp`` in flight, so a step of fewer micro-batches holds fewer buffers; the
    price is one pipeline fill and drain (a bubble) per accumulation step, which the step time shows."""
    batch = batch_of(spec, layout, w, cluster.gpus)
    for k in (2**i for i in range(1, 12)):
        if batch.micro % k or batch.micro // k < layout.pp:
            break
        change = {"microbatches": batch.micro // k, "grad_accum": w.grad_accum * k}
        if p := _fitting(spec, strategy, sharding, layout, replace(w, **change), cluster):
            return (f"fits with --microbatches {change['microbatches']} --grad-accum {change['grad_accum']}: "
                    f"{_peak_of(p, cluster)}, step {p['step_time_s']:,.3g} s (the pipeline allocates a receive "
                    "buffer per micro-batch of a schedule step; accumulation steps reuse them, at one more fill "
                    "and drain each)")  # fmt: skip
    return None


def _fitting(
    spec: ModelSpec, strategy: str, sharding: str, layout: Layout, w: Workload, cluster: Cluster
) -> dict[str, Any] | None:
    """The plan of ``w`` when it is valid and fits, else None."""
    try:
        p = evaluate(spec, strategy, sharding, layout, w, cluster)
    except ConfigError:
        return None
    return p if p["fits"] else None


def _peak_of(p: dict[str, Any], cluster: Cluster) -> str:
    return f"peak {p['bytes_per_rank']['peak'] / 1e9:,.1f} GB of {cluster.gpu_mem_bytes / 1e9:,.0f}"


def with_defaults(w: Workload, cluster: Cluster, precision: str | None) -> Workload:
    """``precision`` None: fp32 on ``cpu-local`` (what paratrain runs on CPU), bf16 on a GPU cluster."""
    if precision is None:
        precision = "fp32" if cluster.name.startswith("cpu-local") else "bf16"
    return replace(w, precision=precision)


def ep_plans(spec: Any, cluster: Any, w: Any, strategy: str | None, ep: int | None, overload: float,
             dp_shard: int | None = None, dp_replicate: int | None = None, tp: int | None = None,
             pp: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The plans of ``strategy`` (an expert-parallel name of :data:`~paratrain.plan.moe.EP_STRATEGIES`;
    ``None``: each, at its default degrees, where they apply) for ``spec``."""
    from paratrain.plan import memory as mem
    from paratrain.plan.moe import EP_STRATEGIES, MoEShape, apply_expert_parallel, check_ep

    moe: MoEShape | None = getattr(spec, "moe", None)
    names = [strategy] if strategy is not None else list(EP_STRATEGIES)
    options = {"microbatches": w.microbatches, "pp_schedule": w.pp_schedule, "offload": w.offload,
               "sequence_parallel": w.sequence_parallel, "loss_parallel": w.loss_parallel}  # fmt: skip
    out = []
    for name in names:
        base, _ = EP_STRATEGIES[name]
        try:
            _, sharding, layout = lay.resolve(base, cluster.gpus, shape=spec.shape, gpus_per_node=cluster.gpus_per_node,
                                              tp=tp, pp=pp, dp_shard=dp_shard, dp_replicate=dp_replicate,
                                              model=spec.name, options=options)  # fmt: skip
        except ConfigError as e:
            if strategy is None:
                continue  # a default layout this cluster cannot run
            raise ConfigError(str(e).replace(f"strategy {base!r}", f"strategy {name!r}")) from e
        stage_ranks = layout.gpus // layout.pp  # the ranks ep borrows from: dp x tp of one stage
        degree = ep if ep is not None else (stage_ranks if name == "ep" else 2)
        if strategy is None and (moe is None or stage_ranks % degree or moe.n_experts % degree or degree < 2):
            continue  # a default that does not apply to this model or cluster
        if strategy is not None and degree < 2 and cluster.gpus > 1:
            raise ConfigError(f"strategy {name!r} splits the experts over an ep axis; give --ep 2 or more.")
        check_ep(moe, degree, stage_ranks, spec.name)
        assert moe is not None
        # under `ep` alone the parameters mix DTensors (the experts) and plain tensors, so the trainer's `auto`
        # falls back to torch's default kernel; with FSDP every parameter is a DTensor and the fused one runs
        mixed = sharding != "full" and w.optimizer_implementation == "auto"
        we = replace(w, optimizer_implementation="default") if mixed else w
        row = evaluate(
            spec, base, sharding, layout, replace(we, moe_ep=degree, moe_overload=overload), cluster
        )
        intra = degree <= cluster.gpus_per_node
        alpha = cluster.intra_latency if intra else cluster.inter_latency
        beta = 1 / (cluster.intra_bw if intra else cluster.inter_bw)
        d = mem.dtypes(w.precision, w.optimizer, w.momentum)
        p = apply_expert_parallel(row, name, moe, degree, spec.num_params, overload, d, alpha, beta,
                                  cluster.gpu_mem_bytes)  # fmt: skip
        p["advice"] = []
        out.append(p)
    return out
