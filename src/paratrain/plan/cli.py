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
from dataclasses import dataclass, replace
from typing import Any

from paratrain.config import (
    TRAIN,
    RunConfig,
    add_command_arguments,
    add_set_argument,
    cli_options,
    command_config,
    set_values,
)
from paratrain.config import add_arguments as add_config_arguments
from paratrain.config import apply_arguments as apply_config_arguments
from paratrain.errors import ConfigError, suggest
from paratrain.plan.api import Workload, plan
from paratrain.plan.model import (
    FALLBACK_SHAPES,
    ModelSpec,
    TransformerShape,
    shape_from_config,
    spec_from_module,
    spec_from_params,
    spec_from_shape,
)
from paratrain.plan.moe import moe_from_config
from paratrain.plan.options import PlanConfig
from paratrain.plan.recommend import recommend, sweep
from paratrain.plan.report import format_plans, format_sweep
from paratrain.spec import hardware as cl

ModelBuilder = Callable[[str], tuple[Any, Any]]
DIGITS_INPUT = (1, 8, 8)
"""Input of paratrain's default dataset (digits: 8x8 images, 10 classes); models that are not
transformers are traced on it."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``paratrain plan``: every ``paratrain train`` flag (generated from the same typed config
    fields, with ``--config`` and ``--set``), so that a train command line with ``train`` replaced by ``plan``
    plans that run, and the planner's own (:class:`PlanConfig`: the model as a bare count, the cluster, the
    output), generated the same way."""
    p.add_argument(
        "--config", help="TOML file with [model], [data], [strategy], [optimizer], [train], ... tables"
    )
    add_config_arguments(p, TRAIN)
    add_set_argument(p, "--set model.dim=8192 model.n_layers=80, as train takes it")
    add_command_arguments(p, PlanConfig)
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(frozen=True)
class Request:
    """What a plan command line asks for: the run's typed config and which of its fields the user set
    (the others are train's defaults, which the planner may replace with better guesses, and says so)."""

    cfg: RunConfig
    given: frozenset[str]

    def has(self, key: str) -> bool:
        return key in self.given

    def value(self, key: str) -> Any:
        """``section.key`` of the config when the user set it, else None."""
        if key not in self.given:
            return None
        sec, name = key.split(".", 1)
        return getattr(getattr(self.cfg, sec), name)


def request_from(args: argparse.Namespace) -> Request:
    """``--config`` file, then the flags, then ``--set`` (train's order), with the keys each one set."""
    given: set[str] = set()
    cfg = RunConfig()
    if getattr(args, "config", None):
        cfg = RunConfig.from_toml(args.config)
        given |= {
            f"{sec}.{k}"
            for sec, table in _toml(args.config).items()
            if isinstance(table, dict)
            for k in table
        }
    cfg = apply_config_arguments(cfg, args, TRAIN)
    given |= {f"{o.section}.{o.key}" for o in cli_options(TRAIN) if getattr(args, o.dest, None) is not None}
    sets = set_values(args)
    if sets:
        cfg = cfg.override(sets)
        given |= {x.split("=", 1)[0].strip() for x in sets}
    return Request(cfg, frozenset(given))


def _toml(path: str) -> dict[str, Any]:
    import tomllib

    with open(path, "rb") as f:
        return tomllib.load(f)


def _torch_available() -> bool:
    """Whether torch is installed, without importing it (a refused typo then costs no torch import)."""
    import importlib.util

    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


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
    from paratrain.spec import catalog

    known = [n for n, _ in catalog.models()]  # the registries' names, without importing torch for a typo
    if name not in known:
        raise ConfigError(f"unknown model {name!r}. {suggest(name, [*known, *PRESETS, *FALLBACK_SHAPES])}")
    import torch

    from paratrain.config import ModelConfig
    from paratrain.models import build_model

    with torch.device("meta"):
        return build_model(ModelConfig(name=name), DIGITS_INPUT, 10), None


LLAMA_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len",
                "tie_embeddings")  # fmt: skip
"""``model.*`` fields that reshape a Llama preset (``--set model.dim=...``), as train applies them."""


def _tokenizer_vocab(req: Request, notes: list[str]) -> int | None:
    """The vocabulary train gives a Llama: the tokenizer's, when the run names its text data."""
    if not (req.has("data.name") or req.has("data.tokenizer")):
        return None
    tok = req.cfg.data.tokenizer
    if tok == "byte":
        return 256
    head, _, n = tok.partition(":")
    if head == "bpe" and n.isdigit():
        notes.append(f"vocabulary {n} from --set data.tokenizer={tok}: a trained BPE can end smaller; "
                     "set model.vocab_size to plan an exact one")  # fmt: skip
        return int(n)
    return None


def _llama_config(req: Request, notes: list[str]) -> Any:
    """The Llama train would build: the preset, the ``model.*`` overrides, the tokenizer's vocabulary, a
    max_seq_len that covers ``--seq-len``."""
    from paratrain.spec.llama import PRESETS, resolve_config

    name, m = req.cfg.model.name, req.cfg.model
    overrides = {k: getattr(m, k) for k in LLAMA_FIELDS if getattr(m, k) is not None}
    vocab = _tokenizer_vocab(req, notes)
    if vocab is not None:
        overrides.setdefault("vocab_size", vocab)
    seq = req.value("data.seq_len")
    if seq is not None:
        overrides.setdefault("max_seq_len", max(PRESETS[name].max_seq_len, seq))
    return resolve_config(name, overrides)


def _reshaped(shape: TransformerShape, req: Request) -> TransformerShape:
    """A shape-only preset (``gpt3-175b``) with the ``--set model.*`` fields applied, as a Llama preset takes
    them; a GPT keeps its conventions where a field is not given (4·dim MLP, one KV head per head), and its
    learned positions cover ``--seq-len``."""
    m = req.cfg.model
    given = {k: getattr(m, k) for k in LLAMA_FIELDS if req.has(f"model.{k}")}
    tied = given.pop("tie_embeddings", None)
    values = {**given, **({"tied_embeddings": bool(tied)} if tied is not None else {})}
    if shape.arch == "gpt":
        if "n_kv_heads" in values and values["n_kv_heads"] != values.get("n_heads", shape.n_heads):
            raise ConfigError(
                f"model.n_kv_heads={values['n_kv_heads']}: a GPT shape has one key/value head per attention "
                "head; leave model.n_kv_heads unset (it follows model.n_heads)."
            )
        values.setdefault("n_kv_heads", values.get("n_heads", shape.n_heads))
        values.setdefault("ffn_hidden", 4 * values.get("dim", shape.dim))
    seq = req.value("data.seq_len")
    if seq is not None:
        values.setdefault("max_seq_len", max(shape.max_seq_len, seq))
    return replace(shape, **values) if values else shape


def _data_shape(req: Request) -> tuple[tuple[int, ...], int]:
    """Input shape and outputs of the run's dataset (train builds the model for them; digits by default)."""
    if not req.has("data.name") and req.cfg.data.name == "digits":
        return DIGITS_INPUT, 10
    from paratrain.data import build_dataset

    data = build_dataset(req.cfg.data)
    return tuple(data.input_shape), int(data.num_outputs)


def model_spec(args: argparse.Namespace, builder: ModelBuilder | None = None, req: Request | None = None,
               notes: list[str] | None = None) -> ModelSpec:  # fmt: skip
    """The model the run trains: ``--params``, a Llama preset reshaped by ``--set model.*``, a registered
    model built for the run's ``--data``, or whatever ``builder`` returns for the name."""
    req = req or request_from(args)
    notes = notes if notes is not None else []
    named = req.has("model.name")
    if named == (args.params is not None):
        raise ConfigError(
            "give exactly one of --model NAME (exact, from the model) or --params N (states only)."
        )
    if args.params is not None:
        return spec_from_params(args.params)
    from paratrain.plan.hf_config import hf_config_path, spec_from_hf_config

    hf_path = hf_config_path(req.cfg.model.name)  # hf:DIR or a config.json: the shape from the JSON alone
    if hf_path is not None:
        return spec_from_hf_config(hf_path, req.cfg.model.name)
    from paratrain.spec.llama import PRESETS

    name = req.cfg.model.name
    if builder is None and name in PRESETS:
        config = _llama_config(req, notes)
        moe = moe_from_config(config)
        if moe is not None and not _torch_available():
            raise ConfigError(
                f"planning the mixture-of-experts model {name!r} counts its experts on a meta build, which needs "
                "torch. Install torch, or plan a dense shape."
            )
        if moe is None:  # a dense preset by arithmetic, no torch: the same spec as its meta build
            return replace(spec_from_shape(shape_from_config(config), name), moe=moe_from_config(config))  # type: ignore[arg-type]
        import torch

        from paratrain.models.llama import Llama

        with torch.device("meta"):
            module = Llama(config)
        return replace(
            spec_from_module(module, name, shape=shape_from_config(config)), moe=moe_from_config(config)
        )
    if builder is None and name not in FALLBACK_SHAPES and _torch_available() and ":" not in name:
        from paratrain.spec import catalog

        known = [n for n, _ in catalog.models()]  # the registries' names, without importing torch for a typo
        if name not in known:
            raise ConfigError(
                f"unknown model {name!r}. {suggest(name, [*known, *PRESETS, *FALLBACK_SHAPES])}"
            )
        from paratrain.models import build_model

        input_shape, outputs = _data_shape(req)
        import torch

        with torch.device("meta"):
            built = build_model(req.cfg.model, input_shape, outputs)
        return spec_from_module(built, name, input_shape=input_shape)
    module, config = (builder or default_model_builder)(name)
    shape = shape_from_config(config)
    moe = moe_from_config(config)
    if module is None:
        if shape is None:
            raise ConfigError(f"model {name!r}: the builder returned neither a module nor a shape.")
        if builder is None and name in FALLBACK_SHAPES:
            shape = _reshaped(shape, req)
        return replace(spec_from_shape(shape, name), moe=moe)
    spec = spec_from_module(module, name, shape=shape, input_shape=None if shape else DIGITS_INPUT)
    return replace(spec, moe=moe)


def cluster_from(
    args: argparse.Namespace, req: Request | None = None, notes: list[str] | None = None
) -> cl.Cluster:
    """The preset (``--cluster``; ``cpu-local`` for ``--device cpu``), its GPU (``--gpu``), the ranks of the run
    (``--gpus``, or ``--nnodes`` x ``--nproc-per-node``) and the overrides."""
    req = req or request_from(args)
    notes = notes if notes is not None else []
    name = args.cluster or ("cpu-local" if req.value("launch.device") == "cpu" else "h100-nvlink-ib")
    base = cl.preset(name)
    c = cl.calibrate(args.calibrate, base if name != "cpu-local" else None) if args.calibrate else base
    nproc, nnodes = req.value("launch.nproc_per_node"), req.value("launch.nnodes")
    for flag, value in (
        ("--gpus-per-node", args.gpus_per_node),
        ("--nproc-per-node", nproc),
        ("--nnodes", nnodes),
    ):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be a positive integer, got {value}.")
    gpus, per_node = args.gpus, args.gpus_per_node
    if nproc is not None:
        if gpus is not None and gpus != nproc and per_node is None:
            per_node = nproc
        gpus = gpus or nproc * (nnodes or 1)
        per_node = per_node or nproc
    changes: dict[str, Any] = {}
    if gpus is not None:
        changes["gpus"] = gpus
        changes["gpus_per_node"] = per_node or min(c.gpus_per_node, gpus)
        if c.name.startswith("cpu-local") and args.gpu_mem is None:
            changes["gpu_mem_bytes"] = cl._host_memory() / changes["gpus_per_node"]
    elif per_node is not None:
        changes["gpus_per_node"] = per_node
    if args.gpu is not None:
        g = cl.gpu(args.gpu)
        changes.update(gpu_mem_bytes=g.mem_bytes, gpu_flops=g.flops(_precision(args, req, c)), fp8_flops=g.fp8_flops,
                       name=f"{c.name.split(' ')[0]} with {args.gpu}")  # fmt: skip
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
    elif not c.on_cpu:
        # the GPU --gpu names, not the preset's name it is appended to ("h100-nvlink-ib with a100-80gb")
        device = cl.gpu(args.gpu).name if args.gpu is not None else c.name
        calibrated = cl.default_efficiency(device, _precision(args, req, c), compiled=req.cfg.train.compile,
                                           fp8=args.fp8)  # fmt: skip
        if calibrated is not None:  # the calibrated efficiency is a wide matmul's: the width model with it
            changes.update(efficiency=calibrated, matmul_knee=cl.MATMUL_KNEE)
    if args.matmul_knee is not None:
        if args.matmul_knee < 0:
            raise ConfigError(f"--matmul-knee must be 0 (off: --efficiency is the whole step's) or a positive "
                              f"matmul width, got {args.matmul_knee:g}.")  # fmt: skip
        changes["matmul_knee"] = float(args.matmul_knee)
    out = replace(c, **changes) if changes else c
    if args.fp8 and not out.fp8_flops:
        raise ConfigError(f"--fp8: {out.name} has no fp8 tensor cores in its data sheet (fp8 peak unknown); "
                          "drop --fp8, or plan a GPU that has them: --gpu h100, h200, b200 or mi300x.")  # fmt: skip
    return out


def _precision(args: argparse.Namespace, req: Request, c: cl.Cluster) -> str:
    if args.fp16_mixed:
        return "fp16-mixed"
    given = req.value("train.precision")
    return given or ("fp32" if c.name.startswith("cpu-local") else "bf16")


def workload_from(args: argparse.Namespace, c: cl.Cluster, req: Request | None = None,
                  notes: list[str] | None = None) -> Workload:  # fmt: skip
    """The batch and training settings of the run, from the same config fields train reads."""
    req = req or request_from(args)
    notes = notes if notes is not None else []
    cfg = req.cfg
    precision = _precision(args, req, c)
    if not req.has("train.precision") and not args.fp16_mixed and precision != cfg.train.precision:
        notes.append(f"precision {precision} assumed on {c.name} (train's default is {cfg.train.precision}; "
                     "give --precision to plan another)")  # fmt: skip
    if cfg.train.compile:
        notes.append("--compile: time at the compiled efficiency; memory planned as eager (fused kernels keep "
                     "fewer activations than planned)")  # fmt: skip
    if cfg.strategy.comm_algorithm != "native":
        notes.append(
            f"--comm-algorithm {cfg.strategy.comm_algorithm}: time planned with the backend's own collectives"
        )
    return Workload(
        batch_size=req.value("train.batch_size"), seq_len=req.value("data.seq_len"), grad_accum=cfg.train.grad_accum,
        microbatches=cfg.strategy.microbatches, activation_checkpointing=cfg.train.activation_checkpointing,
        optimizer=cfg.optimizer.name, momentum=cfg.optimizer.momentum, precision=precision,
        optimizer_implementation=cfg.optimizer.implementation,
        offload=cfg.strategy.offload, attention=args.attention, sequence_parallel=cfg.strategy.sequence_parallel,
        loss_parallel=cfg.strategy.loss_parallel, pp_schedule=cfg.strategy.pp_schedule,
        bucket_cap_mb=cfg.strategy.bucket_cap_mb, gradient_as_bucket_view=cfg.strategy.gradient_as_bucket_view,
        reduce_fp32=args.reduce_fp32, fp8_all_gather=args.fp8_all_gather, compile_loss=args.compile_loss,
        pp_return_outputs=args.pp_return_outputs, shard_accumulated_grads=cfg.strategy.shard_accumulated_grads,
        fp8=args.fp8, compile=cfg.train.compile,
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
    command_config(PlanConfig, args)
    req = request_from(args)
    degrees = {k: req.value(f"strategy.{k}") for k in ("tp", "pp", "dp_shard", "dp_replicate")}
    strategy = req.value("strategy.name")
    if args.recommend and args.sweep_gpus:
        raise ConfigError(
            "give --recommend or --sweep-gpus, not both (a sweep recommends at every GPU count)."
        )
    degrees["ep"] = req.value("strategy.ep")
    if (args.recommend or args.sweep_gpus) and (strategy or any(v is not None for v in degrees.values())):
        raise ConfigError(
            "--recommend/--sweep-gpus search the layouts themselves; drop --strategy and the degrees."
        )
    notes: list[str] = []
    spec = model_spec(args, model_builder, req, notes)
    c = cluster_from(args, req, notes)
    w = workload_from(args, c, req, notes)
    if spec.attention and spec.attention != w.attention:
        notes.append(f"attention {spec.attention}: transformers runs {spec.arch} without SDPA, so its attention "
                     "scores are kept for backward")  # fmt: skip
        w = replace(w, attention=spec.attention)
    if w.seq_len is None and spec.shape is not None:
        notes.append(f"sequence length {spec.shape.max_seq_len} (the model's max_seq_len) assumed: train runs "
                     f"--seq-len {req.cfg.data.seq_len} unless given; pass --seq-len to plan another")  # fmt: skip
    if args.sweep_gpus:
        out = sweep(spec, c, parse_gpu_range(args.sweep_gpus), w)
    elif args.recommend:
        out = recommend(spec, c, w, top=args.top)
    else:
        out = plan(spec, c, w, strategy, **degrees, moe_overload=args.moe_overload)
    out["notes"] = notes + out.get("notes", [])
    return out


def run(args: argparse.Namespace, model_builder: ModelBuilder | None = None) -> int:
    """Run ``paratrain plan``; returns the exit code. ConfigError propagates (the CLI prints it, exit 2)."""
    command_config(PlanConfig, args)  # checks the planner's own options first
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
        for note in result.get("notes", []):
            print(f"note: {note}")
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
