"""Typed configuration: one dataclass per component, TOML files, ``--set section.key=value`` overrides.

Each option is declared once, here: a dataclass field with a docstring underneath it (torchtitan's
convention). The field's ``option(...)`` metadata says whether it is also a command-line flag, and under
which name; :func:`add_arguments` generates the argparse flags from the fields, with the docstrings as
help, and :func:`apply_arguments` writes what the user passed back into the config. One converter
(:func:`convert`) turns TOML values, JSON values and command-line strings into the declared types.

Every dataclass checks its own fields in ``__post_init__``. Checks that need several sections or the
world size live in :meth:`RunConfig.validate`. Names that live in a registry (strategy, model, dataset)
are refused by the registries themselves, in the launching process, before any worker starts: this
module imports no registry.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import math
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

from paratrain.errors import ConfigError, suggest

COMM_ALGORITHMS: tuple[str, ...] = ("native", "ring", "tree", "naive", "rhd", "shm", "pairwise")
"""Every collective algorithm name, in one place: ``comm``, ``--comm-algorithm`` and ``bench comm`` use it."""

TRACKERS: tuple[str, ...] = ("csv", "tensorboard", "mlflow", "wandb")
"""Experiment trackers of ``--tracker`` (``paratrain.train.trackers``)."""

AC_MODES: tuple[str, ...] = ("none", "full", "selective")
"""``--activation-checkpointing`` modes; ``selective:N`` (every N-th block fully recomputed) is also valid."""


def ac_policy(value: str | bool | None) -> tuple[str, int]:
    """``(mode, every)`` of an ``activation_checkpointing`` value: ``none``/``full``/``selective`` (op-level) or
    ``selective:N`` -> ``("full", N)`` for every N-th block; ``true``/``false`` are ``full``/``none``."""
    if value is None or value is False or value == "false":
        return "none", 1
    if value is True or value == "true":
        return "full", 1
    head, _, n = str(value).partition(":")
    if head in AC_MODES and not n:
        return head, 1
    if head == "selective" and n.isdigit() and int(n) >= 1:
        return ("full", 1) if int(n) == 1 else ("every", int(n))
    raise ConfigError(f"train.activation_checkpointing={value!r} is not valid: choose none, full, selective (save "
                      "the outputs of matmuls and attention, recompute the rest) or selective:N (every N-th "
                      "block fully recomputed, N >= 1).")  # fmt: skip


TRAIN, LAUNCH = "train", "launch"
"""Commands whose flags an option appears under (``option(scope=...)``)."""


def option(
    default: Any = dataclasses.MISSING,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: Sequence[str] | None = None,
    scope: tuple[str, ...] = (TRAIN,),
    metavar: str | None = None,
    default_factory: Any = dataclasses.MISSING,
    const: tuple[str, str] | None = None,
) -> Any:
    """A config field that is also a command-line flag (``--field-name`` unless ``flag`` is given). ``const``
    ``(on, off)``: the flag alone means ``on`` and ``--no-field-name`` means ``off`` (a boolean grown choices)."""
    md = {
        "const": const,
        "cli": True,
        "flag": flag,
        "aliases": aliases,
        "choices": choices,
        "scope": scope,
        "metavar": metavar,
    }
    if default_factory is not dataclasses.MISSING:
        return field(default_factory=default_factory, metadata=md)
    return field(default=default, metadata=md)


def _check_positive(section: str, name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is not None and not math.isfinite(value):  # NaN passed `<= 0`; inf is no setting either
        raise ConfigError(f"{section}.{name} must be a finite number, got {value!r}. Set a value > 0.")
    if value is None or value <= 0:
        raise ConfigError(f"{section}.{name} must be positive, got {value!r}. Set a value > 0.")


def choice(default: str, choices: Sequence[str]) -> Any:
    """A config field (not a flag) whose value is one of ``choices``, checked by :func:`_check_choices`."""
    return field(default=default, metadata={"choices": tuple(choices)})


def _check_choice(section: str, name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{section}.{name}={value!r} is not valid. {suggest(value, choices)}")


def _check_choices(obj: Any, section: str) -> None:
    """Every field of ``obj`` declared with ``choices`` (:func:`option` or :func:`choice`) holds one of them:
    the choices are stated once, where the field is declared."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if choices is not None:
            _check_choice(section, f.name, getattr(obj, f.name), choices)


def _check_range(section: str, name: str, value: float, lo: float, hi: float, hi_open: bool = False) -> None:
    ok = lo <= value < hi if hi_open else lo <= value <= hi
    if not ok:
        bracket = ")" if hi_open else "]"
        raise ConfigError(f"{section}.{name} must be in [{lo}, {hi}{bracket}, got {value!r}.")


@dataclass
class ModelConfig:
    name: str = option("cnn", flag="--model")
    """Model from the model registry (``mlp``, ``cnn``, ``resnet18``, ...; ``paratrain models`` lists them), or
    your own factory ``pkg.module:function`` (docs/python-api.md)."""
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
    dim: int | None = None
    """Llama models: hidden size (``None``: the preset's)."""
    n_layers: int | None = None
    """Llama models: transformer blocks (``None``: the preset's)."""
    n_heads: int | None = None
    """Llama models: attention heads (``None``: the preset's); must divide by ``--tp``."""
    n_kv_heads: int | None = None
    """Llama models: key/value heads of grouped-query attention (``None``: the preset's)."""
    ffn_hidden: int | None = None
    """Llama models: hidden size of the SwiGLU MLP (``None``: the preset's)."""
    vocab_size: int | None = None
    """Llama models: vocabulary (``None``: the tokenizer's)."""
    max_seq_len: int | None = None
    """Llama models: longest sequence the rotary tables cover (``None``: the preset's, or ``--seq-len``)."""
    tie_embeddings: bool | None = None
    """Llama models: share the input embedding and the output head (``None``: the preset's)."""
    n_experts: int | None = None
    """Llama models: routed experts per MoE layer, 0 for a dense model (``None``: the preset's)."""
    top_k: int | None = None
    """Llama MoE: experts each token is routed to (``None``: the preset's)."""
    n_shared_experts: int | None = None
    """Llama MoE: always-on shared experts (``None``: the preset's)."""
    moe_every: int | None = None
    """Llama MoE: an MoE feed-forward in every k-th layer, dense elsewhere (``None``: the preset's)."""
    first_dense_layers: int | None = None
    """Llama MoE: leading dense layers before the first MoE one (``None``: the preset's)."""
    moe_hidden: int | None = None
    """Llama MoE: hidden width of each expert, 0 for ``ffn_hidden`` (``None``: the preset's)."""
    capacity_factor: float | None = None
    """Llama MoE: 0 is dropless; otherwise tokens past ``capacity_factor * tokens * top_k / n_experts`` per
    expert are dropped (``None``: the preset's)."""
    router_score: str | None = None
    """Llama MoE: ``softmax`` or ``sigmoid`` router scores (``None``: the preset's)."""
    router_renorm: bool | None = None
    """Llama MoE: renormalise the chosen experts' weights to sum to 1 (``None``: the preset's)."""
    aux_loss_coef: float | None = None
    """Llama MoE: coefficient of the sequence-level balance loss, 0 for none (``None``: the preset's)."""
    bias_update_rate: float | None = None
    """Llama MoE: step of the auxiliary-loss-free expert bias per optimizer step (``None``: the preset's)."""
    init_from: str | None = option(None, flag="--init-from", metavar="hf:DIR")
    """Llama models: start from the weights of a Hugging Face ``LlamaForCausalLM`` directory of the same shape
    (names mapped and rotary rows permuted; ``--model hf:DIR`` loads its own weights instead)."""

    def __post_init__(self) -> None:
        for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            _check_positive("model", key, getattr(self, key), allow_none=True)
        _check_positive("model", "hidden", self.hidden)
        _check_positive("model", "layers", self.layers)
        _check_positive("model", "channels", self.channels)
        _check_range("model", "dropout", self.dropout, 0.0, 1.0, hi_open=True)


@dataclass
class DataConfig:
    name: str = option("digits", flag="--data", metavar="NAME[:PATH]")
    """Dataset: ``digits``, ``synthetic-classification``, ``synthetic-regression``, ``python-stdlib`` (this
    interpreter's standard-library sources as text); a path-backed dataset is written ``NAME:PATH`` (for
    example ``mnist:/data/mnist`` or ``text:/data/books``), which sets ``path``."""
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
    seq_len: int = option(256)
    """Text datasets: tokens per training sequence (batches are packed, fixed-length sequences)."""
    tokenizer: str = "byte"
    """Text datasets: ``byte`` (UTF-8 bytes, vocabulary 256), ``bpe:N`` (a BPE of N tokens trained with
    Hugging Face tokenizers on the training split, cached in the run directory) or ``hf:DIR`` (a Hugging Face
    model's ``tokenizer.json``; the default with ``--model hf:DIR`` when the directory has one)."""
    max_bytes: int | None = None
    """Text datasets: read at most this many bytes of each split (``None``: all)."""
    cache_dir: str | None = None
    """Text datasets: where a trained tokenizer is cached (default: the run directory)."""
    text_field: str = "text"
    """``jsonl`` records: the field that holds the text (records with ``prompt``/``completion`` need none)."""

    def __post_init__(self) -> None:
        if ":" in self.name and self.path is None:
            self.name, self.path = self.name.split(":", 1)
        if not 0.0 < self.test_fraction < 1.0:
            raise ConfigError(f"data.test_fraction must be in (0, 1), got {self.test_fraction!r}.")
        _check_positive("data", "num_samples", self.num_samples)
        _check_positive("data", "seq_len", self.seq_len)
        _check_positive("data", "max_bytes", self.max_bytes, allow_none=True)
        if self.tokenizer != "byte" and not self.tokenizer.startswith("hf:") and not (
            self.tokenizer.startswith("bpe:")
            and self.tokenizer[4:].isdigit()
            and int(self.tokenizer[4:]) > 256
        ):
            raise ConfigError(
                f"data.tokenizer={self.tokenizer!r}: use byte, or bpe:N with N > 256 (for example bpe:4096)."
            )
        _check_positive("data", "num_features", self.num_features)
        if self.num_classes < 2:
            raise ConfigError(f"data.num_classes must be at least 2, got {self.num_classes!r}.")


@dataclass
class StrategyConfig:
    name: str = option("ddp", flag="--strategy")
    """Parallel strategy from the registry (``paratrain strategies`` lists them)."""
    dp_replicate: int | None = option(None)
    """Data-parallel replicas: ranks that hold the same (shard of the) model and all-reduce gradients.
    Default: what the strategy preset says (``ddp``: every data-parallel rank; ``hsdp``: world / shard size)."""
    dp_shard: int | None = option(None)
    """Data-parallel ranks the model, gradients and optimizer state are sharded over (ZeRO/FSDP).
    Default: what the strategy preset says (``zero*``: every data-parallel rank)."""
    tp: int | None = option(None)
    """Tensor-parallel degree (innermost mesh axis: consecutive ranks, one node). Default: what the strategy
    preset says (``tp``: every rank; ``fsdp+tp``, ``fsdp+tp+pp``: 2; the others: 1)."""
    pp: int | None = option(None)
    """Pipeline-parallel degree (outermost mesh axis). Default: what the strategy preset says (``pp``: every
    rank; ``fsdp+pp``, ``fsdp+tp+pp``: 2; the others: 1)."""
    ep: int | None = option(None)
    """Expert-parallel degree (``ep``, ``fsdp+ep``): each MoE layer's experts split over this many ranks,
    borrowed from the data-parallel ones. Default: the preset's (``ep``: every rank; ``fsdp+ep``: 2)."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB (``ddp``, ``dp``, ``zero1``/``zero2``)."""
    gradient_as_bucket_view: bool = False
    """``ddp``: let gradients alias the all-reduce buckets (saves one gradient copy of memory and the copies
    in and out of the buckets). Always on with ``--comm-algorithm shm``."""
    static_graph: bool = False
    """``ddp``: declare that the autograd graph is the same every step."""
    find_unused_parameters: bool = False
    """``ddp``: look for parameters that got no gradient. Off by default: it costs a graph walk per step."""
    comm_algorithm: str = option("native", choices=COMM_ALGORITHMS)
    """Collectives of the gradient sync: ``native`` (the backend's own) or one of paratrain's algorithms
    (``dp``: any; ``ddp``: ``native`` or ``shm`` (a DDP comm hook); ``zero1``/``zero2``: ``native`` or ``shm``;
    the others: ``native`` only)."""
    shard_size: int | None = option(None)
    """``hsdp``: ranks per shard group (sharded within a group, replicated across groups); must divide the
    world size. Default: half the world size. Same as ``--dp-shard`` for ``hsdp``."""
    offload: bool = option(False)
    """``zero3``/``hsdp``: keep parameters, gradients and optimizer state on the CPU (FSDP2
    ``CPUOffloadPolicy``); the optimizer steps on the CPU. On a CPU-only machine this changes nothing."""
    mixed_precision: str = choice("fp32", ("fp32", "bf16"))
    """``zero3``/``hsdp``: ``fp32``, or ``bf16`` (bf16 parameters for compute and bf16 gradient reduction,
    fp32 sharded master weights and optimizer state; FSDP2 ``MixedPrecisionPolicy``)."""
    shard_units: str = "blocks"
    """``zero3``/``hsdp``: modules wrapped as their own shard unit before the root: ``blocks`` (each of
    ``model.blocks``), ``root`` (only the whole model), or comma-separated submodule names (``blocks.0,head``)."""
    pp_schedule: str = option("1f1b", choices=("gpipe", "1f1b", "interleaved-1f1b"))
    """Pipeline schedule (``pp``, ``fsdp+pp``, ``fsdp+tp+pp``): ``gpipe`` (all forwards, then all backwards),
    ``1f1b`` (one forward, one backward in the steady state), ``interleaved-1f1b`` (2 stages per rank)."""
    microbatches: int | None = option(None)
    """Pipeline micro-batches per optimizer step (per accumulation step). Default: the pipeline degree."""
    sequence_parallel: bool = option(True)
    """Tensor parallel: shard the norms' activations along the sequence (all-gather before attention and
    the MLP, reduce-scatter after) instead of replicating them (all-reduce)."""
    loss_parallel: bool = option(False)
    """Tensor parallel: compute the cross-entropy on the vocabulary-sharded logits without gathering them."""

    def __post_init__(self) -> None:
        _check_positive("strategy", "microbatches", self.microbatches, allow_none=True)
        _check_choices(self, "strategy")
        _check_positive("strategy", "bucket_cap_mb", self.bucket_cap_mb)
        _check_positive("strategy", "shard_size", self.shard_size, allow_none=True)
        _check_positive("strategy", "dp_replicate", self.dp_replicate, allow_none=True)
        _check_positive("strategy", "dp_shard", self.dp_shard, allow_none=True)
        _check_positive("strategy", "tp", self.tp, allow_none=True)
        _check_positive("strategy", "pp", self.pp, allow_none=True)
        _check_positive("strategy", "ep", self.ep, allow_none=True)
        if not self.shard_units.strip():
            raise ConfigError(
                "strategy.shard_units is empty: use blocks, root, or module names like blocks.0,head"
            )


@dataclass
class OptimizerConfig:
    name: str = option("adamw", flag="--optimizer", choices=("adamw", "sgd"))
    """``adamw`` (default) or ``sgd``."""
    lr: float = option(3e-3)
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (``adamw``) or L2 penalty (``sgd``)."""
    momentum: float = 0.9
    """Momentum of ``sgd``."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas, each in [0, 1)."""
    grad_clip: float | None = None
    """Clip gradients to this global L2 norm (computed across all ranks and shards). ``None``: no clipping."""
    schedule: str = choice("constant", ("constant", "cosine"))
    """Learning-rate schedule: ``constant`` or ``cosine`` (with ``warmup_steps`` of linear warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up steps."""

    def __post_init__(self) -> None:
        _check_choices(self, "optimizer")
        _check_positive("optimizer", "lr", self.lr)
        _check_positive("optimizer", "grad_clip", self.grad_clip, allow_none=True)
        if self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay!r}.")
        if self.momentum < 0:
            raise ConfigError(f"optimizer.momentum must be >= 0, got {self.momentum!r}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps!r}.")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        for i, b in enumerate(self.betas):
            _check_range("optimizer", f"betas[{i}]", b, 0.0, 1.0, hi_open=True)


@dataclass
class TrainConfig:
    steps: int | None = option(None)
    """Optimizer steps to run. Give ``steps`` or ``epochs``; ``steps`` wins when both are set."""
    epochs: int | None = option(8)
    """Passes over the training split (used when ``steps`` is not set)."""
    batch_size: int = option(64)
    """Global batch size: samples per optimizer step summed over all data-parallel ranks."""
    grad_accum: int = option(1)
    """Micro-batches accumulated per optimizer step; gradients are synchronised only on the last one."""
    precision: str = option("fp32", choices=("fp32", "bf16", "fp16"))
    """``fp32``, ``bf16`` (autocast, CPU and GPU) or ``fp16`` (autocast + GradScaler, GPU only)."""
    seed: int = option(0)
    """Seed for every RNG; identical on all ranks so that models start identical."""
    eval_every: int = option(0)
    """Evaluate every N steps (0: only at the end)."""
    eval_batches: int | None = option(None)
    """Evaluate on at most this many global batches (``--batch-size`` samples each) of the test split, the
    same first samples every time (0: the whole split). Default: 20 (the small tensor datasets whole), 4 for
    a language model (its evaluation in seconds)."""
    keep_best: bool = option(False)
    """Save a checkpoint at each evaluation that improves the eval loss and keep it (``checkpoints/best``
    names it; retention never deletes it)."""
    log_every: int | None = option(None)
    """Print a progress line (without a terminal) and write a ``metrics.jsonl`` line every N steps.
    Default: a line about every 10 s of wall time, and a metrics line every 10 steps."""
    run_dir: str | None = option(None)
    """Where metrics, logs and checkpoints go. Default: ``runs/<time>-<strategy>``."""
    progress: bool | None = None
    """Progress bar on rank 0. ``None``: only when stderr is a terminal."""
    sync_batchnorm: bool | None = option(None)
    """Convert BatchNorm to SyncBatchNorm before wrapping. ``None``: on when the model has BatchNorm, there
    is more than one data-parallel rank and the per-rank micro-batch is smaller than 16."""
    activation_checkpointing: str | bool = option("none", const=("full", "none"),
                                                  metavar="{none,full,selective,selective:N}")  # fmt: skip
    """Recompute activations in backward instead of keeping them: ``full`` (each block keeps only its input;
    the flag alone), ``selective`` (op-level: each block keeps the outputs of its matmuls and attention and
    recomputes the cheap ops, the norms, activations and element-wise products), ``selective:N`` (every N-th
    block fully recomputed), ``none``. ``true``/``false`` mean ``full``/``none``."""
    plan_check: bool = option(True)
    """Before any worker starts, predict the run's peak memory per rank with the planner and refuse a run that
    cannot fit the device (naming the cheapest change that fits); ``--no-plan-check`` launches anyway."""
    check_desync_every: int = option(0)
    """Every K optimizer steps, compare a digest of every parameter and buffer across the ranks that should
    hold identical copies, and stop at the first divergence naming the step, the tensor and the ranks
    (0: off). The same check as ``paratrain launch --guard``."""
    on_nonfinite: str = option("stop", choices=("stop", "skip"))
    """A NaN or inf in the loss or a gradient, on any rank: ``stop`` the run before the optimizer step (exit
    non-zero, naming the step, the rank and the parameter), or ``skip`` the step (as fp16 loss scaling does)."""
    max_nonfinite_skips: int = 10
    """``on_nonfinite=skip``: stop anyway after this many skipped steps."""
    compile: bool = option(False)
    """``torch.compile`` each of the model's blocks (after activation checkpointing, before the data-parallel
    wrap). Needs a C++ compiler on CPU. Not with tensor parallelism (``tp``, ``fsdp+tp``, ``fsdp+tp+pp`` with
    tp > 1): refused before launch, because the compiled blocks' backward fails on the DTensor gradients."""
    profile: str | None = option(None, metavar="START:END")
    """Profile optimizer steps START..END (inclusive, e.g. 5:8) with torch.profiler on every rank: a trace
    per rank in ``RUN_DIR/profile/`` and a per-rank compute/communication table (docs/observability.md)."""
    tensorboard: bool = option(False)
    """Write loss, learning rate, throughput, memory and eval metrics to ``RUN_DIR/tensorboard/`` (rank 0;
    needs ``pip install 'paratrain[tensorboard]'``). The same as ``--tracker tensorboard``."""
    tracker: str | None = option(None, metavar="csv,tensorboard,mlflow,wandb")
    """Experiment trackers, comma-separated: rank 0 logs the run's config as hyperparameters and, at every
    logging step and evaluation, loss, learning rate, throughput and eval metrics (docs/observability.md).
    ``mlflow`` writes a local file store in ``RUN_DIR/mlruns`` and ``wandb`` runs offline unless
    ``MLFLOW_TRACKING_URI`` / ``WANDB_MODE`` say otherwise."""

    def __post_init__(self) -> None:
        if self.tracker is not None:
            names = [n.strip() for n in self.tracker.split(",") if n.strip()]
            for n in names:
                _check_choice("train", "tracker", n, TRACKERS)
            self.tracker = ",".join(dict.fromkeys(names)) or None
        if self.profile is not None:
            start, _, end = self.profile.partition(":")
            if not (start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
                raise ConfigError(f"train.profile={self.profile!r}: write START:END, the first and last "
                                  "optimizer steps to profile, with 1 <= START <= END (e.g. --profile 5:8).")  # fmt: skip
            if self.steps is not None and int(start) > self.steps:
                raise ConfigError(f"--profile {self.profile}: the run has only {self.steps} steps (--steps); "
                                  f"profile steps within 1..{self.steps}.")  # fmt: skip
        _check_positive("train", "batch_size", self.batch_size)
        _check_positive("train", "steps", self.steps, allow_none=True)
        _check_positive("train", "epochs", self.epochs, allow_none=True)
        _check_positive("train", "grad_accum", self.grad_accum)
        _check_positive("train", "log_every", self.log_every, allow_none=True)
        if self.eval_batches is not None and self.eval_batches < 0:
            raise ConfigError(
                f"train.eval_batches must be >= 0 (0: the whole test split), got {self.eval_batches!r}."
            )
        _check_choices(self, "train")
        mode, every = ac_policy(self.activation_checkpointing)
        self.activation_checkpointing = f"selective:{every}" if mode == "every" else mode
        if self.steps is None and self.epochs is None:
            raise ConfigError("train: give train.steps or train.epochs (--steps N or --epochs N).")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0, got {self.eval_every!r}.")
        if self.check_desync_every < 0:
            raise ConfigError(f"train.check_desync_every must be >= 0, got {self.check_desync_every!r}.")
        if self.max_nonfinite_skips < 0:
            raise ConfigError(f"train.max_nonfinite_skips must be >= 0, got {self.max_nonfinite_skips!r}.")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"train.seed must be in [0, 2**63), got {self.seed!r}.")


@dataclass
class CheckpointConfig:
    dir: str | None = option(None, flag="--ckpt-dir")
    """Checkpoint directory (``DIR/step_NNNNNNNN/``). Default: ``<run_dir>/checkpoints``."""
    every: int = option(0, flag="--ckpt-every")
    """Save every N optimizer steps (0: only at the end)."""
    save_at_end: bool = True
    """Save when training ends cleanly."""
    resume: str = option("auto", metavar="auto|never|PATH")
    """``auto``: load ``DIR/latest`` when present; ``never``: start fresh; or a path to a step directory."""
    keep_last: int | None = option(None)
    """Keep only the newest K committed checkpoints (``None``: keep all)."""
    async_save: bool = option(False, flag="--async-checkpoint")
    """Write checkpoints in the background (DCP ``async_save``): training blocks only to copy state to CPU."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every must be >= 0, got {self.every!r}.")
        _check_positive("checkpoint", "keep_last", self.keep_last, allow_none=True)
        if self.resume.strip() == "":
            raise ConfigError("checkpoint.resume is empty: use auto, never, or the path of a step directory.")


_BOTH = (TRAIN, LAUNCH)


@dataclass
class LaunchConfig:
    nproc_per_node: int | None = option(None, aliases=("--nproc_per_node",), scope=_BOTH)
    """Worker processes on this node. Default: one per GPU when GPUs are present, else 2."""
    nnodes: str = option("1", scope=_BOTH, metavar="N|MIN:MAX")
    """Number of nodes, or an elastic range ``MIN:MAX``."""
    node_rank: int = option(0, aliases=("--node_rank",), scope=_BOTH)
    """Rank of this node (static multi-node rendezvous)."""
    rdzv_endpoint: str | None = option(None, aliases=("--rdzv_endpoint",), scope=_BOTH, metavar="HOST:PORT")
    """``HOST:PORT`` of the rendezvous. Default: ``127.0.0.1`` on a free port (single node)."""
    rdzv_backend: str = option("c10d", aliases=("--rdzv_backend",), scope=_BOTH, choices=("c10d", "static"))
    """Rendezvous backend of the elastic agent."""
    rdzv_id: str | None = option(None, aliases=("--rdzv_id",), scope=_BOTH)
    """Job id shared by all nodes of one job."""
    rdzv_conf: str | None = option(None, aliases=("--rdzv_conf",), scope=_BOTH, metavar="KEY=VALUE,...")
    """torchrun's ``--rdzv-conf``: ``key=value,...`` for the c10d rendezvous, e.g. ``last_call_timeout=5,
    keep_alive_interval=1`` (see docs/launch.md for the keys)."""
    master_port: int | None = option(None, aliases=("--master_port",), scope=_BOTH)
    """Explicit port for the single-node rendezvous on 127.0.0.1 (checked to be free before starting)."""
    max_restarts: int = option(0, aliases=("--max_restarts",), scope=_BOTH)
    """Times the elastic agent restarts the worker group after a failure."""
    backend: str = option("auto", choices=("auto", "gloo", "nccl"))
    """Process-group backend: ``auto`` (NCCL with CUDA, else Gloo), ``gloo`` or ``nccl``."""
    timeout_s: float = option(300.0, flag="--timeout")
    """Process-group timeout in seconds: a collective waiting longer fails, naming what it waited for."""
    device: str = option("auto", scope=_BOTH, choices=("auto", "cpu", "cuda"))
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``. Under ``launch`` the script picks its own device;
    there ``cpu`` only lifts the one-process-per-GPU check (and the default of one worker per GPU)."""
    cpu_bind: str = option("none", scope=_BOTH, choices=("none", "cores"))
    """``cores``: pin each worker to its own equal block of the cores the launcher may use (its CPU affinity,
    so a Slurm cpuset or ``taskset`` holds), local rank r on block r, with ``OMP_NUM_THREADS`` the block's
    size unless set; with more workers than cores, local rank r on core ``r mod cores``. Linux only.
    ``none``: the OS places the workers."""
    fail_at_step: int | None = option(None)
    """Fault injection: rank ``fail_rank`` SIGKILLs itself after this optimizer step, on the first attempt only."""
    fail_rank: int = option(0)
    """The rank that ``fail_at_step`` kills."""

    def __post_init__(self) -> None:
        _check_positive("launch", "nproc_per_node", self.nproc_per_node, allow_none=True)
        _check_positive("launch", "fail_at_step", self.fail_at_step, allow_none=True)
        if self.fail_rank < 0:
            raise ConfigError(f"launch.fail_rank must be >= 0, got {self.fail_rank!r}.")
        if self.node_rank < 0:
            raise ConfigError(f"launch.node_rank must be >= 0, got {self.node_rank!r}.")
        _check_choices(self, "launch")
        _check_positive("launch", "timeout_s", self.timeout_s)
        if self.max_restarts < 0:
            raise ConfigError(f"launch.max_restarts must be >= 0, got {self.max_restarts!r}.")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"launch.master_port must be in 1..65535, got {self.master_port!r}.")
        if self.rdzv_endpoint is not None:
            host, sep, port = self.rdzv_endpoint.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(
                    f"launch.rdzv_endpoint={self.rdzv_endpoint!r}: write HOST:PORT with a port in 1..65535, "
                    "e.g. --rdzv-endpoint 10.0.0.1:29500."
                )
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
        sections = _sections()
        kwargs: dict[str, Any] = {}
        for sec_name, values in data.items():
            if sec_name not in sections:
                raise ConfigError(f"{source}: unknown section [{sec_name}]. {suggest(sec_name, sections)}")
            if not isinstance(values, Mapping):
                raise ConfigError(f"{source}: [{sec_name}] must be a table of key = value pairs.")
            kwargs[sec_name] = _build_section(sections[sec_name], sec_name, values, source)
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
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
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
        """Apply ``section.key=value`` strings; values are converted to the field's declared type."""
        data = self.to_dict()
        sections = _sections()
        for item in assignments:
            if "=" not in item:
                raise ConfigError(f"--set {item!r}: write section.key=value, e.g. --set optimizer.lr=0.01")
            path, raw = item.split("=", 1)
            if "." not in path:
                raise ConfigError(f"--set {item!r}: the key must be section.key, e.g. train.steps")
            sec, key = path.strip().split(".", 1)
            if sec not in sections:
                raise ConfigError(f"--set {item!r}: unknown section {sec!r}. {suggest(sec, sections)}")
            hints = typing.get_type_hints(sections[sec])
            if key not in hints:
                raise ConfigError(f"--set {item!r}: unknown key {sec}.{key}. {suggest(key, hints)}")
            data[sec][key] = convert(raw.strip(), hints[key], f"{sec}.{key}")
        return RunConfig.from_dict(data, source="--set")

    # ---- cross-section validation -----------------------------------------------------------------
    def validate(self, world_size: int, data_parallel_size: int | None = None) -> None:
        """Checks that need the world size. Raises :class:`ConfigError`."""
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
            fix = f"e.g. --batch-size {max(per_step, self.train.batch_size // per_step * per_step)}"
            if per_step > self.train.batch_size:  # more ranks than samples: fewer processes is the real fix
                fits = [
                    d for d in range(1, dp + 1) if self.train.batch_size % (d * self.train.grad_accum) == 0
                ]
                fix = (
                    f"or, more likely, fewer processes: {dp} data-parallel ranks cannot share a global batch of "
                    f"{self.train.batch_size} (--nproc-per-node {max(fits)} would, or a --batch-size of at "
                    f"least {per_step})"
                )
            raise ConfigError(
                f"train.batch_size={self.train.batch_size} (global) is not divisible by data-parallel size "
                f"{dp} x grad_accum {self.train.grad_accum} = {per_step}. Use a multiple of {per_step}, {fix}."
            )


# ---- one converter for TOML values, JSON values and command-line strings -----------------------------
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def convert(value: Any, tp: Any, where: str) -> Any:
    """``value`` as the declared type ``tp``: strings (flags, ``--set``) are parsed, TOML/JSON values are
    checked; ints widen to floats; floats must be finite. Raises :class:`ConfigError` naming ``where``."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if type(None) in get_args(tp) and (
            value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        ):
            return None
        errors = []
        for arg in args:
            try:
                return convert(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is tuple:
        args = get_args(tp)  # type: ignore[assignment]
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]  # type: ignore[assignment]
        if not isinstance(value, list | tuple) or len(value) != len(args):
            raise ConfigError(f"{where}: expected {len(args)} comma-separated values, got {value!r}")
        return tuple(
            convert(v.strip() if isinstance(v, str) else v, a, where)
            for v, a in zip(value, args, strict=True)
        )
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        number: float | None = None
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        elif isinstance(value, int | float) and not isinstance(value, bool):
            number = float(value)
        if number is None:
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{where}: must be a finite number, got {value!r}.")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _sections() -> dict[str, type]:
    return {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)}


def _build_section(cls: type, sec: str, values: Mapping[str, Any], source: str) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{source}: unknown key {sec}.{key}. {suggest(key, hints)}")
        kwargs[key] = convert(value, hints[key], f"{sec}.{key}")
    return cls(**kwargs)


# ---- command-line flags generated from the fields ----------------------------------------------------
@dataclass(frozen=True)
class CliOption:
    """One config field exposed as a flag."""

    section: str
    key: str
    flags: tuple[str, ...]
    type: Any
    choices: Sequence[str] | None
    help: str
    metavar: str | None
    default: Any
    const: tuple[str, str] | None = None

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.key}"


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of dataclass ``cls`` (parsed from its source with ``ast``)."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (frozen app): help without text
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.replace("``", "").split())
    return docs


def cli_options(scope: str, sections: Sequence[str] | None = None) -> list[CliOption]:
    """Every field of :class:`RunConfig` declared with :func:`option` for command ``scope``."""
    out = []
    for sec, cls in _sections().items():
        if sections is not None and sec not in sections:
            continue
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            md = f.metadata
            if not md.get("cli") or scope not in md["scope"]:
                continue
            flag = md["flag"] or "--" + f.name.replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            out.append(CliOption(sec, f.name, (flag, *md["aliases"]), hints[f.name], md["choices"],
                                 docs.get(f.name, ""), md["metavar"], default, md.get("const")))  # fmt: skip
    return out


def _base_type(tp: Any) -> Any:
    if get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in get_args(tp) if a is not type(None))
    return tp


def add_arguments(parser: argparse.ArgumentParser, scope: str, sections: Sequence[str] | None = None) -> None:
    """Add one flag per config option of ``scope``; unset flags stay ``None`` (the config's value wins)."""
    for o in cli_options(scope, sections):
        base = _base_type(o.type)
        text = o.help + (f" (default: {o.default})" if o.default not in (None, False) else "")
        kwargs: dict[str, Any] = {"dest": o.dest, "default": None, "help": text.replace("%", "%%")}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif o.const:
            kwargs.update(nargs="?", const=o.const[0], metavar=o.metavar or o.key.upper())
            parser.add_argument(*o.flags, **kwargs)
            negative = "--no-" + o.flags[0].removeprefix("--")
            parser.add_argument(
                negative, dest=o.dest, action="store_const", const=o.const[1], help=argparse.SUPPRESS
            )
            continue
        else:
            where = o.flags[0]
            kwargs["type"] = lambda raw, _tp=o.type, _w=where: _parse_flag(raw, _tp, _w)
            kwargs["choices"] = list(o.choices) if o.choices else None
            kwargs["metavar"] = o.metavar or ("{" + ",".join(o.choices) + "}" if o.choices else o.key.upper())
        parser.add_argument(*o.flags, **kwargs)


def _parse_flag(raw: str, tp: Any, where: str) -> Any:
    try:
        return convert(raw, tp, where)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None


def apply_arguments(cfg: RunConfig, args: argparse.Namespace, scope: str) -> RunConfig:
    """Write the flags the user gave (not ``None``) into ``cfg``; each section is re-validated."""
    data = cfg.to_dict()
    for o in cli_options(scope):
        value = getattr(args, o.dest, None)
        if value is not None:
            data[o.section][o.key] = value
    return RunConfig.from_dict(data, source="command line")


def iter_options(scope: str) -> Iterator[str]:
    """Flag names of ``scope`` (for docs and tests)."""
    for o in cli_options(scope):
        yield from o.flags


__all__ = [
    "COMM_ALGORITHMS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LaunchConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "StrategyConfig",
    "TrainConfig",
    "add_arguments",
    "apply_arguments",
    "convert",
]
