"""The plan guards every launch: ``paratrain train`` plans its own configuration before any worker starts.

:func:`check_launch` runs in the launching process on the meta model (registered into
``launch.train_job.PREFLIGHT_CHECKS`` by :func:`register`, which the ``train`` command calls; launch sits below
the planner and never imports it). It predicts the peak bytes per rank of the run exactly as configured
(:func:`paratrain.plan.api.plan` with the run's strategy, degrees, batch, precision and checkpointing) and
compares it with the device's memory: the GPU's total memory, or on the CPU the machine's available memory
divided among the local ranks. A run that does not fit is refused with the plan's figures and the cheapest
change that fits, tried in this order: with gradient accumulation under FSDP, ``--shard-accumulated-grads``
(one gradient shard held instead of the whole gradients); selective then full activation checkpointing, then a smaller micro-batch
(``--grad-accum`` doubled, the same global batch, up to 64x) with each, then a sharding strategy (zero2, zero3). ``--no-plan-check``
launches anyway. The predicted peak goes into the run's summary beside the measured one.

A transformer (a model with a Llama config) is planned in full; other models by their states only (tracing
their activations would cost every launch ~10 s of torch imports). The planner's limits are not the run's: a configuration the planner cannot express (a model it cannot trace,
a strategy it does not model) is launched with a note, never refused.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

from paratrain.config import RunConfig
from paratrain.errors import ConfigError
from paratrain.plan.api import Workload, plan
from paratrain.plan.model import (
    ModelSpec,
    shape_from_config,
    spec_from_module,
    spec_from_params,
    spec_from_shape,
)
from paratrain.plan.moe import moe_from_config
from paratrain.spec import hardware as hw

PREDICTED_ENV = "PARATRAIN_PREDICTED_PEAK"
"""Environment variable the predicted peak per rank (bytes) travels in to the run's summary."""


def available_memory() -> float:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), else all of RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return hw._host_memory()


def device_cluster(world: int, nproc: int, cuda: bool) -> hw.Cluster:
    """The machine the run is about to use: this GPU (memory, peak from :data:`GPUS`) or this CPU."""
    per_node = max(1, min(nproc, world))
    if not cuda:
        base = hw.PRESETS["cpu-local"]
        return replace(base, gpus=world, gpus_per_node=per_node, gpu_mem_bytes=available_memory() / per_node)
    import torch

    props = torch.cuda.get_device_properties(0)
    flops = hw.gpu_peak_flops(props.name, "bf16") or hw.PRESETS["h100-nvlink-ib"].gpu_flops
    return replace(hw.PRESETS["h100-nvlink-ib"], gpus=world, gpus_per_node=per_node,
                   gpu_mem_bytes=float(props.total_memory), gpu_flops=flops, name=f"local {props.name}")  # fmt: skip


def run_spec(cfg: RunConfig, meta_model: Any, input_shape: tuple[int, ...]) -> ModelSpec:
    # an hf: model: the shape from its config.json, as `paratrain plan --model hf:DIR` reads it
    if cfg.model.name.startswith("hf:"):
        from paratrain.plan.hf_config import hf_config_path, spec_from_hf_config

        try:
            path = hf_config_path(cfg.model.name)
            if path is not None:
                built = meta_model if getattr(meta_model, "config", None) is not None else None
                return spec_from_hf_config(path, cfg.model.name, built)
        except ConfigError:  # a model type the planner has no shape for: its states, as below
            pass
    config = getattr(meta_model, "config", None)
    shape = shape_from_config(config) if config is not None else None
    moe = moe_from_config(config) if config is not None else None
    if shape is not None and moe is not None:  # its experts counted on the meta build, as `plan` counts them
        return replace(spec_from_module(meta_model, cfg.model.name, shape=shape), moe=moe)
    if shape is not None:
        return spec_from_shape(shape, cfg.model.name)
    # Other models: their states only. Tracing their activations (plan/trace.py) first imports torch's
    # dispatch machinery, ~10 s of CPU on every launch; their activations are small next to a transformer's.
    return spec_from_params(float(sum(p.numel() for p in meta_model.parameters())), cfg.model.name)


def run_workload(cfg: RunConfig, input_shape: tuple[int, ...], pp: int, lm: bool) -> Workload:
    s, t = cfg.strategy, cfg.train
    return Workload(
        batch_size=t.batch_size, seq_len=input_shape[0] if lm else None, grad_accum=t.grad_accum,
        microbatches=s.microbatches or (pp if pp > 1 else None), activation_checkpointing=t.activation_checkpointing,
        optimizer=cfg.optimizer.name, momentum=cfg.optimizer.momentum, precision=t.precision, offload=s.offload,
        optimizer_implementation=cfg.optimizer.implementation,
        sequence_parallel=s.sequence_parallel, loss_parallel=s.loss_parallel, pp_schedule=s.pp_schedule,
        bucket_cap_mb=s.bucket_cap_mb, gradient_as_bucket_view=s.gradient_as_bucket_view,
        shard_accumulated_grads=s.shard_accumulated_grads,
    )  # fmt: skip


def _peak(
    spec: ModelSpec, c: hw.Cluster, w: Workload, strategy: str, degrees: dict[str, int]
) -> dict[str, Any]:
    return dict(plan(spec, c, w, strategy, **degrees)["plans"][0])


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def cheapest_fit(
    spec: ModelSpec, c: hw.Cluster, w: Workload, strategy: str, degrees: dict[str, int]
) -> str | None:
    """The first change (in the module docstring's order) under which the run fits, with its peak."""
    tries: list[tuple[str, Workload, str, dict[str, int]]] = []
    if w.grad_accum > 1 and not w.shard_accumulated_grads and degrees.get("pp", 1) == 1:
        # FSDP's accumulation holds the whole gradients unsharded; one reduce-scatter per micro-step holds a shard
        tries.append(
            ("--shard-accumulated-grads", replace(w, shard_accumulated_grads=True), strategy, degrees)
        )
    modes = [m for m in ("selective", "full") if m != w.activation_checkpointing]
    for i in range(7):  # the micro-batch halved (--grad-accum doubled) up to 6 times, with each checkpointing
        accum = w.grad_accum * 2**i
        for ac in ([w.activation_checkpointing] if i else []) + modes:
            change = " ".join(x for x in (f"--activation-checkpointing {ac}" if ac != w.activation_checkpointing else "",
                                          f"--grad-accum {accum}" if i else "") if x)  # fmt: skip
            tries.append(
                (change, replace(w, grad_accum=accum, activation_checkpointing=ac), strategy, degrees)
            )
    for name in ("zero2", "zero3"):
        if name != strategy and degrees.get("tp", 1) == 1 and degrees.get("pp", 1) == 1:
            tries.append((f"--strategy {name}", w, name, {}))
    for change, w2, name, deg in tries:
        try:
            p = _peak(spec, c, w2, name, deg)
        except ConfigError:
            continue
        if p["fits"]:
            return f"{change} (predicted peak {_gb(p['bytes_per_rank']['peak'])})"
    return None


def check_launch(cfg: RunConfig, world: int, nproc: int, meta_model: Any, input_shape: tuple[int, ...],
                 topology: dict[str, int], cuda: bool) -> None:  # fmt: skip
    """Refuse the run when its predicted peak per rank exceeds the device's memory (module docstring)."""
    os.environ.pop(PREDICTED_ENV, None)
    if not cfg.train.plan_check:
        return
    lm = getattr(meta_model, "config", None) is not None and len(input_shape) == 1
    try:
        spec = run_spec(cfg, meta_model, input_shape)
        c = device_cluster(world, nproc, cuda)
        w = run_workload(cfg, input_shape, topology.get("pp", 1), lm)
        w = replace(w, attention=spec.attention) if spec.attention else w
        p = _peak(spec, c, w, cfg.strategy.name, topology)
    except (ConfigError, ValueError, RuntimeError, NotImplementedError) as e:
        print(f"paratrain: note: the memory plan of this run is not checked ({e})", file=sys.stderr)
        return
    peak = float(p["bytes_per_rank"]["peak"])
    os.environ[PREDICTED_ENV] = str(round(peak))
    if p["fits"]:
        return
    where = "GPU memory" if cuda else f"available memory / {c.gpus_per_node} local ranks"
    b = p["bytes_per_rank"]
    fix = cheapest_fit(spec, c, w, cfg.strategy.name, topology)
    raise ConfigError(
        f"this run needs about {_gb(peak)} per rank at its peak ({p['peak_moment']['phase']}: parameters "
        f"{_gb(b['params'])}, gradients {_gb(b['grads'])}, optimizer {_gb(b['optimizer'])}, activations "
        f"{_gb(b['activations'])}, buffers {_gb(b['buffers'])}), and the device has {_gb(c.gpu_mem_bytes)} ({where}). "
        + (
            f"The cheapest change that fits: {fix}. "
            if fix
            else "No single change of checkpointing, micro-batch or "
            "sharding fits: lower --batch-size or --seq-len, or add ranks. "
        )
        + "`paratrain plan` with the same flags shows the breakdown; --no-plan-check launches anyway."
    )


def register() -> None:
    """Add :func:`check_launch` to the launcher's pre-flight checks (once)."""
    from paratrain.launch import train_job

    if check_launch not in train_job.PREFLIGHT_CHECKS:
        train_job.PREFLIGHT_CHECKS.append(check_launch)
