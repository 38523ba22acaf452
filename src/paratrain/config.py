"""Typed configuration: one dataclass per component, TOML files, ``--set section.key=value`` overrides.

Every field carries a docstring-style comment underneath it (torchtitan's convention) and every dataclass
checks its own fields in ``__post_init__``. Checks that need more than one section, or the world size,
live in :meth:`RunConfig.validate`, which the CLI calls *before* any process is started, so that a bad
input fails in one clear message instead of N worker tracebacks.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


class ConfigError(ValueError):
    """A bad configuration value. The message names the field, what is wrong and how to fix it."""


def _suggest(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Choose one of: {', '.join(sorted(choices))}.{hint}"


def _check_positive(section: str, name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{section}.{name} must be positive, got {value!r}. Set a value > 0.")


def _check_choice(section: str, name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not valid. {_suggest(value, choices)}")


@dataclass
class ModelConfig:
    name: str = "cnn"
    """Model from the model registry: ``mlp``, ``cnn`` (more are added by later components)."""
    hidden: int = 128
    """Hidden width of ``mlp`` layers."""
    layers: int = 2
    """Number of hidden layers (``mlp``)."""
    channels: int = 32
    """Channels of the first convolution (``cnn``); later blocks double it."""
    dropout: float = 0.0
    """Dropout probability before the classifier head."""
    batchnorm: bool = False
    """Use BatchNorm after each convolution of ``cnn``."""

    def __post_init__(self) -> None:
        _check_positive("model", "hidden", self.hidden)
        _check_positive("model", "layers", self.layers)
        _check_positive("model", "channels", self.channels)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout!r}.")


@dataclass
class DataConfig:
    name: str = "digits"
    """Dataset: ``digits``, ``synthetic-classification``, ``synthetic-regression``; a path-backed dataset is
    written ``NAME:DIR`` (for example ``mnist:/data/mnist``), which sets ``path``."""
    path: str | None = None
    """Directory of a file-backed dataset."""
    test_fraction: float = 0.2
    """Fraction held out for evaluation (deterministic split by ``train.seed``)."""
    num_samples: int = 4096
    """Number of samples of a synthetic dataset."""
    num_features: int = 32
    """Input features of a synthetic dataset."""
    num_classes: int = 10
    """Classes of ``synthetic-classification``."""
    augment: bool = False
    """Random train-time augmentation where the dataset defines one."""

    def __post_init__(self) -> None:
        if ":" in self.name and self.path is None:
            self.name, self.path = self.name.split(":", 1)
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"data.test_fraction must be in (0, 1), got {self.test_fraction!r}.")
        _check_positive("data", "num_samples", self.num_samples)
        _check_positive("data", "num_features", self.num_features)
        if self.num_classes < 2:
            raise ConfigError(f"data.num_classes must be at least 2, got {self.num_classes!r}.")


@dataclass
class StrategyConfig:
    name: str = "ddp"
    """Parallel strategy from the registry (``paratrain strategies`` lists them)."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB (``ddp`` and ``dp``)."""
    gradient_as_bucket_view: bool = False
    """``ddp``: let gradients alias the all-reduce buckets (saves one gradient copy of memory)."""
    static_graph: bool = False
    """``ddp``: declare that the autograd graph is the same every step."""
    find_unused_parameters: bool = False
    """``ddp``: look for parameters that got no gradient. Off by default: it costs a graph walk per step."""
    comm_algorithm: str = "native"
    """All-reduce used by ``dp``: ``native``, ``ring``, ``tree``, ``naive``, ``rhd``."""
    shard_size: int | None = None
    """``hsdp``: ranks per shard group (sharded within a group, replicated across groups); must divide the
    world size. Default: half the world size. Only ``hsdp`` takes it."""
    offload: bool = False
    """``zero3``/``hsdp``: keep parameters, gradients and optimizer state on the CPU (FSDP2
    ``CPUOffloadPolicy``); the optimizer steps on the CPU."""
    mixed_precision: str = "fp32"
    """``zero3``/``hsdp``: ``fp32``, or ``bf16`` (bf16 parameters for compute and bf16 gradient reduction,
    fp32 sharded master weights and optimizer state; FSDP2 ``MixedPrecisionPolicy``)."""
    shard_units: str = "blocks"
    """``zero3``/``hsdp``: modules wrapped as their own shard unit before the root: ``blocks`` (each of
    ``model.blocks``), ``root`` (only the whole model), or comma-separated submodule names (``blocks.0,head``)."""

    def __post_init__(self) -> None:
        _check_positive("strategy", "bucket_cap_mb", self.bucket_cap_mb)
        _check_positive("strategy", "shard_size", self.shard_size, allow_none=True)
        _check_choice("strategy", "mixed_precision", self.mixed_precision, ["fp32", "bf16"])
        if not self.shard_units.strip():
            raise ConfigError(
                "strategy.shard_units is empty: use blocks, root, or module names like blocks.0,head"
            )
        _check_choice(
            "strategy", "comm_algorithm", self.comm_algorithm, ["native", "ring", "tree", "naive", "rhd"]
        )


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """``adamw`` (default) or ``sgd``."""
    lr: float = 3e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (``adamw``) or L2 penalty (``sgd``)."""
    momentum: float = 0.9
    """Momentum of ``sgd``."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    grad_clip: float | None = None
    """Clip gradients to this global L2 norm (computed across all ranks and shards). ``None``: no clipping."""
    schedule: str = "constant"
    """Learning-rate schedule: ``constant`` or ``cosine`` (with ``warmup_steps`` of linear warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""

    def __post_init__(self) -> None:
        _check_choice("optimizer", "name", self.name, ["adamw", "sgd"])
        _check_positive("optimizer", "lr", self.lr)
        _check_positive("optimizer", "grad_clip", self.grad_clip, allow_none=True)
        _check_choice("optimizer", "schedule", self.schedule, ["constant", "cosine"])
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay!r}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps!r}.")
        self.betas = (float(self.betas[0]), float(self.betas[1]))


@dataclass
class TrainConfig:
    steps: int | None = None
    """Optimizer steps to run. Give ``steps`` or ``epochs``; ``steps`` wins when both are set."""
    epochs: int | None = 8
    """Passes over the training split (used when ``steps`` is not set)."""
    batch_size: int = 64
    """Global batch size: samples per optimizer step summed over all data-parallel ranks."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step; gradients are synchronised only on the last one."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` (autocast, CPU and GPU) or ``fp16`` (autocast + GradScaler, GPU only)."""
    seed: int = 0
    """Seed for every RNG; identical on all ranks so that models start identical."""
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end)."""
    log_every: int = 10
    """Write a metrics line every N steps."""
    run_dir: str | None = None
    """Where metrics and checkpoints go. Default: ``runs/<time>-<strategy>``."""
    progress: bool | None = None
    """Progress bar on rank 0. ``None``: only when stderr is a terminal."""
    sync_batchnorm: bool | None = None
    """Convert BatchNorm to SyncBatchNorm before wrapping. ``None``: on when the model has BatchNorm, there
    is more than one data-parallel rank and the per-rank micro-batch is smaller than 16."""
    activation_checkpointing: bool = False
    """Recompute each of ``model.blocks`` in backward instead of keeping its activations."""

    def __post_init__(self) -> None:
        _check_positive("train", "batch_size", self.batch_size)
        _check_positive("train", "steps", self.steps, allow_none=True)
        _check_positive("train", "epochs", self.epochs, allow_none=True)
        _check_positive("train", "grad_accum", self.grad_accum)
        _check_positive("train", "log_every", self.log_every)
        _check_choice("train", "precision", self.precision, ["fp32", "bf16", "fp16"])
        if self.steps is None and self.epochs is None:
            raise ConfigError("train: give train.steps or train.epochs (--steps N or --epochs N).")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0, got {self.eval_every!r}.")


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory (``DIR/step_NNNNNNNN/``). Default: ``<run_dir>/checkpoints``."""
    every: int = 0
    """Save every N optimizer steps (0: only at the end)."""
    save_at_end: bool = True
    """Save when training ends cleanly."""
    resume: str = "auto"
    """``auto``: load ``DIR/latest`` when present; ``never``: start fresh; or a path to a step directory."""
    keep_last: int | None = None
    """Keep only the newest K committed checkpoints (``None``: keep all)."""
    async_save: bool = False
    """Write checkpoints in the background (DCP ``async_save``): training blocks only to copy state to CPU."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every must be >= 0, got {self.every!r}.")
        _check_positive("checkpoint", "keep_last", self.keep_last, allow_none=True)
        if self.resume.strip() == "":
            raise ConfigError("checkpoint.resume is empty: use auto, never, or the path of a step directory.")


@dataclass
class LaunchConfig:
    nproc_per_node: int | None = None
    """Worker processes on this node. Default: one per GPU when GPUs are present, else 2."""
    nnodes: str = "1"
    """Number of nodes, or an elastic range ``MIN:MAX``."""
    node_rank: int = 0
    """Rank of this node (static multi-node rendezvous)."""
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` of the rendezvous. Default: ``127.0.0.1`` on a free port (single node)."""
    rdzv_backend: str = "c10d"
    """Rendezvous backend of the elastic agent."""
    rdzv_id: str | None = None
    """Job id shared by all nodes of one job."""
    rdzv_conf: str | None = None
    """torchrun's ``--rdzv-conf``: ``key=value,...`` for the c10d rendezvous, e.g. ``last_call_timeout=5,
    keep_alive_interval=1`` (see docs/launch.md for the keys)."""
    master_port: int | None = None
    """Explicit port for the single-node rendezvous (checked to be free before starting)."""
    max_restarts: int = 0
    """Times the elastic agent restarts the worker group after a failure."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (NCCL with CUDA, else Gloo), ``gloo`` or ``nccl``."""
    timeout_s: float = 300.0
    """Process-group timeout: a collective waiting longer than this fails, naming what it waited for."""
    device: str = "auto"
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``."""
    fail_at_step: int | None = None
    """Fault injection: rank ``fail_rank`` SIGKILLs itself after this optimizer step, on the first attempt only."""
    fail_rank: int = 0
    """The rank that ``fail_at_step`` kills."""

    def __post_init__(self) -> None:
        _check_positive("launch", "nproc_per_node", self.nproc_per_node, allow_none=True)
        _check_positive("launch", "fail_at_step", self.fail_at_step, allow_none=True)
        if self.fail_rank < 0:
            raise ConfigError(f"launch.fail_rank must be >= 0, got {self.fail_rank!r}.")
        _check_choice("launch", "backend", self.backend, ["auto", "gloo", "nccl"])
        _check_choice("launch", "device", self.device, ["auto", "cpu", "cuda"])
        _check_positive("launch", "timeout_s", self.timeout_s)
        if self.max_restarts < 0:
            raise ConfigError(f"launch.max_restarts must be >= 0, got {self.max_restarts!r}.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"launch.master_port must be in 1..65535, got {self.master_port!r}.")
        parts = self.nnodes.split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"launch.nnodes={self.nnodes!r}: write a positive count N or a range MIN:MAX.")
        if len(parts) == 2 and int(parts[0]) > int(parts[1]):
            raise ConfigError(f"launch.nnodes={self.nnodes!r}: MIN must not exceed MAX.")


@dataclass
class RunConfig:
    """Everything one ``paratrain train`` run needs, in sections mirroring the components."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> RunConfig:
        """Build from nested ``{section: {key: value}}``; unknown sections or keys are errors."""
        sections = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for sec_name, values in data.items():
            if sec_name not in sections:
                raise ConfigError(
                    f"{source}: unknown section [{sec_name}]. {_suggest(sec_name, list(sections))}"
                )
            if not isinstance(values, Mapping):
                raise ConfigError(f"{source}: [{sec_name}] must be a table of key = value pairs.")
            sec_cls = _section_class(sec_name)
            kwargs[sec_name] = _build_section(sec_cls, sec_name, values, source)
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                f"config file {str(p)!r} does not exist. Pass an existing TOML file to --config."
            )
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        return cls.from_dict(data, source=str(p))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text), source="config json")

    def override(self, assignments: Sequence[str]) -> RunConfig:
        """Apply ``section.key=value`` strings; values are parsed by the field's declared type."""
        data = self.to_dict()
        for item in assignments:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: write section.key=value, e.g. --set optimizer.lr=0.01")
            path, raw = item.split("=", 1)
            if "." not in path:
                raise ConfigError(f"--set {item!r}: the key must be section.key, e.g. train.steps")
            sec, key = path.strip().split(".", 1)
            if sec not in data:
                raise ConfigError(f"--set {item!r}: unknown section {sec!r}. {_suggest(sec, list(data))}")
            sec_cls = _section_class(sec)
            hints = typing.get_type_hints(sec_cls)
            if key not in hints:
                raise ConfigError(f"--set {item!r}: unknown key {sec}.{key}. {_suggest(key, list(hints))}")
            data[sec][key] = parse_value(raw.strip(), hints[key], f"{sec}.{key}")
        return RunConfig.from_dict(data, source="--set")

    # ---- cross-section validation -----------------------------------------------------------------
    def validate(self, world_size: int, data_parallel_size: int | None = None) -> None:
        """Checks that need the world size or the registries. Raises :class:`ConfigError`."""
        from paratrain.data import available_datasets
        from paratrain.models import available_models
        from paratrain.parallel import available_strategies

        _check_choice("strategy", "name", self.strategy.name, available_strategies())
        _check_choice("model", "name", self.model.name, available_models())
        _check_choice("data", "name", self.data.name, available_datasets())
        dp = data_parallel_size if data_parallel_size is not None else world_size
        per_step = dp * self.train.grad_accum
        if self.train.batch_size % dp == 0 and self.train.batch_size % per_step != 0:
            per_rank, k = self.train.batch_size // dp, self.train.grad_accum
            raise ConfigError(
                f"--grad-accum {k} does not divide the per-rank batch {per_rank} (global batch "
                f"{self.train.batch_size} / {dp} data-parallel ranks): each micro-batch must hold the same "
                f"number of samples. Use a --grad-accum that divides {per_rank}, or a --batch-size that is a "
                f"multiple of {per_step}."
            )
        if self.train.batch_size % per_step != 0:
            raise ConfigError(
                f"train.batch_size={self.train.batch_size} (global) is not divisible by data-parallel size "
                f"{dp} x grad_accum {self.train.grad_accum} = {per_step}. Use a multiple of {per_step}, "
                f"e.g. --batch-size {max(per_step, self.train.batch_size // per_step * per_step)}."
            )
        if self.strategy.name == "single" and world_size > 1:
            raise ConfigError(
                f"strategy 'single' runs one process but the world size is {world_size}. "
                "Use --nproc-per-node 1, or a data-parallel strategy such as --strategy ddp."
            )


# ---- helpers -------------------------------------------------------------------------------------------
_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "strategy": StrategyConfig,
    "optimizer": OptimizerConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "launch": LaunchConfig,
}


def _section_class(name: str) -> type:
    return _SECTIONS[name]


def _build_section(cls: type, sec: str, values: Mapping[str, Any], source: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {sec}.{key}. {_suggest(key, list(hints))}")
        kwargs[key] = coerce(value, hints[key], f"{sec}.{key}")
    return cls(**kwargs)


def coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` (from TOML/JSON) against the declared type ``tp``; ints widen to floats."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}={value!r}: expected one of {get_args(tp)}")
        return value
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{where}: expected a list of {len(args)} values, got {value!r}")
        return tuple(coerce(v, a, where) for v, a in zip(value, args, strict=True))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def parse_value(raw: str, tp: Any, where: str) -> Any:
    """Parse a command-line string into the declared type of a config field."""
    low = raw.lower()
    if low in ("none", "null") and type(None) in get_args(tp):
        return None
    base = (
        [a for a in get_args(tp) if a is not type(None)]
        if get_origin(tp) in (typing.Union, types.UnionType)
        else [tp]
    )
    last_err: str = ""
    for arg in base:
        try:
            if arg is bool:
                if low in ("true", "1", "yes", "on"):
                    return True
                if low in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if arg is int:
                return int(raw)
            if arg is float:
                return float(raw)
            if get_origin(arg) is tuple:
                return coerce([float(x) for x in raw.strip("()[]").split(",")], arg, where)
            if arg is str:
                return raw
        except (ValueError, ConfigError):
            last_err = f"{where}: cannot read {raw!r} as {getattr(arg, '__name__', arg)}"
    raise ConfigError(last_err or f"{where}: cannot parse {raw!r}")
