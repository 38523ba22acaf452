"""``paratrain plan``: the flags, the model / cluster / workload they describe, and the table or JSON printed.

The top-level CLI adds a ``plan`` subcommand with :func:`add_arguments` and calls :func:`run`; a
``model_builder(name) -> (nn.Module on the meta device or None, shape/config or None)`` may be passed to
:func:`run` (the default, :func:`default_model_builder`, knows paratrain's registered models and the llama
presets).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from paratrain.errors import ConfigError, suggest
from paratrain.plan.api import Workload, plan
from paratrain.plan.model import (
    FALLBACK_SHAPES,
    ModelSpec,
    shape_from_config,
    spec_from_module,
    spec_from_params,
    spec_from_shape,
)
from paratrain.plan.moe import moe_from_config
from paratrain.plan.recommend import recommend, sweep
from paratrain.plan.report import format_plans, format_sweep
from paratrain.spec import hardware as cl

ModelBuilder = Callable[[str], tuple[Any, Any]]
DIGITS_INPUT = (1, 8, 8)
"""Input of paratrain's default dataset (digits: 8x8 images, 10 classes); models that are not
transformers are traced on it."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``paratrain plan`` (the same names as ``paratrain train``'s where they overlap)."""
    m = p.add_argument_group("model")
    m.add_argument(
        "--model", help="a model paratrain trains (mlp, cnn, resnet18, llama-debug, llama2-7b, ...)"
    )
    m.add_argument("--params", type=float, help="a bare parameter count, e.g. 7.5e9 (model states only)")
    s = p.add_argument_group("parallelism and batch")
    s.add_argument("--strategy", help="ddp, zero1, zero2, zero3, hsdp, tp, pp, fsdp+tp, fsdp+pp, fsdp+tp+pp; "
                   "default: ddp, zero1, zero2, zero3 and the valid tp/pp layouts")  # fmt: skip
    s.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel degree (default: the preset's, as paratrain train picks it; an explicit 1 "
        "is kept, so a tp preset given --tp 1 is refused, as by train)",
    )
    s.add_argument("--pp", type=int, help="pipeline-parallel degree (default and an explicit 1: as --tp)")
    s.add_argument("--dp-shard", type=int, help="ranks each FSDP/ZeRO group shards over")
    s.add_argument("--dp-replicate", type=int, help="data-parallel replicas (HSDP's outer axis)")
    s.add_argument("--ep", type=int, help="expert-parallel degree (strategies ep, fsdp+ep; MoE models)")
    s.add_argument("--moe-overload", type=float, default=1.0,
                   help="MoE: routed rows on the busiest rank over the mean (activations; default 1)")  # fmt: skip
    s.add_argument(
        "--batch-size", type=int, help="GLOBAL batch, sequences/samples (default: multiple of GPUs >= 64)"
    )
    s.add_argument("--microbatches", type=int, help="pipeline micro-batches (default: one sample each)")
    s.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max_seq_len)")
    s.add_argument("--grad-accum", type=int, default=1, help="micro-batches accumulated per optimizer step")
    s.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute every block in backward"
    )
    s.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"], help="default adamw")
    s.add_argument("--precision", choices=["fp32", "bf16", "fp16", "fp16-mixed"],
                   help="fp32; bf16/fp16: autocast over fp32 states (as paratrain train); fp16-mixed: the ZeRO "
                   "paper's 2+2+12 bytes. Default: fp32 on cpu-local, bf16 on GPU clusters")  # fmt: skip
    s.add_argument("--offload", action="store_true", help="FSDP: keep sharded states in host memory")
    s.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"], help="sdpa drops the a·s² term")
    s.add_argument("--pp-schedule", default="1f1b", choices=["1f1b", "gpipe"], help="default 1f1b")
    s.add_argument("--no-sequence-parallel", action="store_true", help="TP without sequence parallelism")
    s.add_argument("--loss-parallel", action="store_true",
                   help="TP: vocabulary-sharded logits through the loss (train: --set strategy.loss_parallel=true)")  # fmt: skip
    c = p.add_argument_group("cluster")
    c.add_argument("--cluster", help=f"preset: {', '.join(cl.PRESETS)} (default h100-nvlink-ib)")
    c.add_argument("--calibrate", metavar="FILE", help="fit α, β from `paratrain bench comm --json` output")
    c.add_argument("--gpus", type=int, help="total GPUs (ranks)")
    c.add_argument("--nproc-per-node", type=int, help="ranks on one node (as paratrain train); sets --gpus")
    c.add_argument("--gpus-per-node", type=int, help="GPUs per node")
    c.add_argument("--gpu-mem", help="memory per GPU, e.g. 80GB (1e9) or 80GiB")
    c.add_argument("--gpu-flops", help="peak FLOP/s per GPU, e.g. 989e12")
    c.add_argument("--intra-bw", help="intra-node bandwidth per GPU, e.g. 450GB/s")
    c.add_argument("--inter-bw", help="inter-node bandwidth per GPU, e.g. 400Gb/s")
    c.add_argument("--intra-latency", help="intra-node latency, e.g. 5us")
    c.add_argument("--inter-latency", help="inter-node latency, e.g. 10us")
    c.add_argument("--efficiency", type=float, help="fraction of peak FLOP/s achieved (default 0.5)")
    o = p.add_argument_group("output")
    o.add_argument("--recommend", action="store_true", help="search and rank every valid layout")
    o.add_argument(
        "--sweep-gpus", metavar="RANGE", help="best layout per GPU count: 8..4096 (x2) or 8,64,512"
    )
    o.add_argument("--top", type=int, default=5, help="layouts --recommend prints (default 5)")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--plot", metavar="PNG", help="bytes per rank by component, and the time breakdown")


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def default_model_builder(name: str) -> tuple[Any, Any]:
    """``(module on the meta device or None, transformer config/shape or None)`` for ``--model NAME``.

    A Llama preset is planned from its module on the meta device when torch is importable (exact parameter
    names for the activation trace), from its shape alone otherwise; the other models need torch to count
    their parameters."""
    from paratrain.spec.llama import PRESETS

    if name in PRESETS:
        cfg = PRESETS[name]
        if not _torch_available():
            return None, cfg
        import torch

        from paratrain.models.llama import Llama

        with torch.device("meta"):
            return Llama(cfg), cfg
    if name in FALLBACK_SHAPES:
        return None, FALLBACK_SHAPES[name]
    if not _torch_available():
        raise ConfigError(
            f"planning model {name!r} needs torch to count its parameters (it is not a transformer shape). "
            "Install torch, or plan a shape: --model llama-*, or --params N."
        )
    import torch

    from paratrain.config import ModelConfig
    from paratrain.models import available_models, build_model

    known = available_models()
    if name not in known:
        raise ConfigError(f"unknown model {name!r}. {suggest(name, [*known, *PRESETS, *FALLBACK_SHAPES])}")
    with torch.device("meta"):
        return build_model(ModelConfig(name=name), DIGITS_INPUT, 10), None


def model_spec(args: argparse.Namespace, builder: ModelBuilder | None = None) -> ModelSpec:
    if (args.model is None) == (args.params is None):
        raise ConfigError(
            "give exactly one of --model NAME (exact, from the model) or --params N (states only)."
        )
    if args.params is not None:
        return spec_from_params(args.params)
    module, config = (builder or default_model_builder)(args.model)
    shape = shape_from_config(config)
    moe = moe_from_config(config)
    if module is None:
        if shape is None:
            raise ConfigError(f"model {args.model!r}: the builder returned neither a module nor a shape.")
        return replace(spec_from_shape(shape, args.model), moe=moe)
    spec = spec_from_module(module, args.model, shape=shape, input_shape=None if shape else DIGITS_INPUT)
    return replace(spec, moe=moe)


def cluster_from(args: argparse.Namespace) -> cl.Cluster:
    base = cl.preset(args.cluster or "h100-nvlink-ib")
    c = (
        cl.calibrate(args.calibrate, base if args.cluster not in (None, "cpu-local") else None)
        if args.calibrate
        else base
    )
    for flag, value in (("--gpus-per-node", args.gpus_per_node), ("--nproc-per-node", args.nproc_per_node)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}.")
    gpus, per_node = args.gpus, args.gpus_per_node
    if args.nproc_per_node is not None:
        if gpus is not None and gpus != args.nproc_per_node and per_node is None:
            per_node = args.nproc_per_node
        gpus = gpus or args.nproc_per_node
        per_node = per_node or args.nproc_per_node
    changes: dict[str, Any] = {}
    if gpus is not None:
        changes["gpus"] = gpus
        changes["gpus_per_node"] = per_node or min(c.gpus_per_node, gpus)
        if c.name.startswith("cpu-local") and args.gpu_mem is None:
            changes["gpu_mem_bytes"] = cl._host_memory() / changes["gpus_per_node"]
    elif per_node is not None:
        changes["gpus_per_node"] = per_node
    if args.gpu_mem is not None:
        changes["gpu_mem_bytes"] = cl.parse_size(args.gpu_mem, "--gpu-mem")
    if args.gpu_flops is not None:
        changes["gpu_flops"] = cl.parse_flops(args.gpu_flops)
    for flag, field, parse in (("intra_bw", "intra_bw", cl.parse_bandwidth), ("inter_bw", "inter_bw", cl.parse_bandwidth),
                               ("intra_latency", "intra_latency", cl.parse_time),
                               ("inter_latency", "inter_latency", cl.parse_time)):  # fmt: skip
        value = getattr(args, flag)
        if value is not None:
            changes[field] = parse(value, "--" + flag.replace("_", "-"))
    if args.efficiency is not None:
        changes["efficiency"] = args.efficiency
    return replace(c, **changes) if changes else c


def workload_from(args: argparse.Namespace, c: cl.Cluster) -> Workload:
    precision = args.precision or ("fp32" if c.name.startswith("cpu-local") else "bf16")
    return Workload(
        batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum, microbatches=args.microbatches,
        activation_checkpointing=args.activation_checkpointing, optimizer=args.optimizer, precision=precision,
        offload=args.offload, attention=args.attention, sequence_parallel=not args.no_sequence_parallel,
        loss_parallel=args.loss_parallel, pp_schedule=args.pp_schedule,
    )  # fmt: skip


def parse_gpu_range(text: str) -> list[int]:
    """``"8..4096"`` → 8, 16, .. 4096 (doubling); ``"8,24,64"``; items mix."""
    out: set[int] = set()
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = re.fullmatch(r"(\d+)\.\.(\d+)", item)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2))
            if lo < 1 or lo > hi:
                raise ConfigError(f"--sweep-gpus: range {item!r} must go up from at least 1.")
            while lo <= hi:
                out.add(lo)
                lo *= 2
        elif item.isdigit() and int(item) > 0:
            out.add(int(item))
        else:
            raise ConfigError(f"--sweep-gpus: cannot read {item!r}; write 8..4096 or 8,16,64.")
    if not out:
        raise ConfigError("--sweep-gpus is empty; write 8..4096 or 8,16,64.")
    return sorted(out)


def build(args: argparse.Namespace, model_builder: ModelBuilder | None = None) -> dict[str, Any]:
    """The result object ``paratrain plan`` prints (plan, recommend or sweep). Raises ConfigError."""
    if args.recommend and args.sweep_gpus:
        raise ConfigError(
            "give --recommend or --sweep-gpus, not both (a sweep recommends at every GPU count)."
        )
    if (args.recommend or args.sweep_gpus) and (args.strategy or any(
            getattr(args, k, None) is not None for k in ("tp", "pp", "dp_shard", "dp_replicate", "ep"))):  # fmt: skip
        raise ConfigError(
            "--recommend/--sweep-gpus search the layouts themselves; drop --strategy and the degrees."
        )
    spec = model_spec(args, model_builder)
    c = cluster_from(args)
    w = workload_from(args, c)
    if args.sweep_gpus:
        return sweep(spec, c, parse_gpu_range(args.sweep_gpus), w)
    if args.recommend:
        return recommend(spec, c, w, top=args.top)
    return plan(
        spec,
        c,
        w,
        args.strategy,
        tp=args.tp,
        pp=args.pp,
        dp_shard=args.dp_shard,
        dp_replicate=args.dp_replicate,
        ep=getattr(args, "ep", None),
        moe_overload=getattr(args, "moe_overload", 1.0),
    )


def run(args: argparse.Namespace, model_builder: ModelBuilder | None = None) -> int:
    """Run ``paratrain plan``; returns the exit code. ConfigError propagates (the CLI prints it, exit 2)."""
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1 (layouts to print), got {args.top}.")
    if args.plot is not None:
        from pathlib import Path

        if not Path(args.plot).resolve().parent.is_dir():
            raise ConfigError(f"--plot {args.plot}: directory {Path(args.plot).parent} does not exist.")
        if Path(args.plot).suffix.lower() != ".png" or Path(args.plot).is_dir():
            raise ConfigError(f"--plot {args.plot}: writes a PNG file; give a file name ending in .png.")
    result = build(args, model_builder)
    if args.plot:
        from paratrain.plan.report import plot

        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_sweep(result) if "sweep" in result else format_plans(result))
        if args.plot:
            print(f"\nwrote {args.plot}")
    return 0


def predict_run(argv: list[str], model_builder: ModelBuilder | None = None) -> dict[str, Any]:
    """The one plan for a ``paratrain train`` run given by the planner's flags (``--model``, ``--strategy``,
    ``--nproc-per-node``, the degrees, batch and precision flags; add ``--cluster cpu-local`` for a CPU run).

    This is what the measured-against-predicted benchmark calls: compare its ``model_state_bytes_per_rank``
    and ``bytes_per_rank["peak"]`` with the run's summary fields of the same names.
    """
    parser = argparse.ArgumentParser(prog="paratrain plan", add_help=False)
    add_arguments(parser)
    result = build(parser.parse_args(argv), model_builder)
    if len(result.get("plans", [])) != 1:
        raise ConfigError("predict_run: give --strategy (or the degrees) so that the flags name one layout.")
    return dict(result["plans"][0])
