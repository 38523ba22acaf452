"""``paratrain train`` in the launching process: every check that can fail before a process starts, then
the workers (``python -m paratrain.train.worker``) under the elastic agent, then the summary.

Nothing here trains: the workers do. What runs here is cheap: the registries refuse unknown names, the
strategy preset turns the flags into the run's one :class:`~paratrain.parallel.topology.Topology` (printing
every factor when they do not multiply to the world size), the dataset is opened, and the model is built
on the meta device to check the options that depend on it (activation checkpointing, resume).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.checkpoint.lock import acquire_checkpoint_lock, preflight_checkpoint_dir
from paratrain.config import RunConfig
from paratrain.errors import ConfigError
from paratrain.launch.agent import (
    gpu_count,
    preflight,
    preflight_train,
    resolve_nproc,
    run_module,
    wait_for_summary,
)
from paratrain.launch.failures import LaunchError
from paratrain.spec.topology import Topology

if TYPE_CHECKING:
    from torch import nn

    from paratrain.data import Splits

PREFLIGHT_CHECKS: list[Callable[..., None]] = []
"""Checks from layers above launch, run on the meta model before any worker starts, as
``check(cfg, world, nproc, meta_model, input_shape, topology_degrees, cuda)``: the planner's memory guard
(``paratrain.plan.guard.register``, called by ``paratrain train``)."""


def preflight_run(cfg: RunConfig) -> int:
    """Every check of ``paratrain train`` that can fail before a process starts. Returns the world size.

    Also resolves the topology (once) into ``cfg.strategy`` (``dp_replicate``/``dp_shard``/``tp``/``pp``), so
    the workers build the mesh the launching process validated.
    """
    from paratrain.checkpoint.inspect import preflight_resume
    from paratrain.data import build_dataset
    from paratrain.models import get_model_builder
    from paratrain.parallel import check_strategy, get_strategy
    from paratrain.train.observe import preflight_observers

    preflight(cfg.launch)
    use_model_tokenizer(cfg)
    preflight_observers(cfg)  # --tensorboard without the tensorboard package
    nnodes = int(cfg.launch.nnodes.split(":")[0])
    nproc = resolve_nproc(cfg.launch)
    world = nproc * nnodes
    strategy = get_strategy(cfg.strategy.name)  # unknown names are refused by the registries themselves
    get_model_builder(cfg.model.name)
    check_strategy(strategy, world, cfg.strategy, nproc)
    dp = strategy.data_parallel_size(world, cfg.strategy, nproc)
    cfg.validate(world, dp)
    uses_cuda = cfg.launch.device == "cuda" or (cfg.launch.device == "auto" and gpu_count() > 0)
    _check_precision(cfg, strategy.name, uses_cuda)
    _check_directories(cfg)
    data = build_dataset(cfg.data, cfg.train.seed)
    check_model_fits_data(cfg.model.name, cfg.data.name, data.task, data.input_shape)
    topo = strategy.topology_for(world, cfg.strategy, nproc)
    _check_batch(cfg, len(data.train), dp, topo, strategy.name)
    meta_model = _meta_model(cfg, data)
    strategy.check_model(meta_model, world, cfg.strategy)
    for check in PREFLIGHT_CHECKS:  # the planner's memory guard: refuses a run that cannot fit
        check(cfg, world, nproc, meta_model, tuple(data.input_shape), topo.degrees(), uses_cuda)
    preflight_train(cfg, world, strategy)  # elastic ranges, fault-injection rank, multi-node run dir
    # a checkpoint of another model, optimizer or training-set size fails here
    reported: list[str] = []
    preflight_resume(cfg, meta_model, cfg.train.run_dir, num_samples=len(data.train), reported=reported)
    # the skipped checkpoints were just reported: the workers' first attempt does not repeat them
    os.environ["PARATRAIN_REPORTED_SKIPS"] = json.dumps(reported)
    if ":" not in cfg.launch.nnodes:  # a fixed world: the workers build exactly the mesh validated here
        cfg.strategy.dp_replicate, cfg.strategy.dp_shard = topo.dp_replicate, topo.dp_shard
        cfg.strategy.tp, cfg.strategy.pp = topo.tp, topo.pp
        if topo.ep > 1:
            cfg.strategy.ep = topo.ep
    return world


def _check_precision(cfg: RunConfig, strategy: str, uses_cuda: bool) -> None:
    """fp16 needs loss scaling: a CUDA device, and gradients that live until the scaler unscales them."""
    if cfg.train.precision == "fp16" and strategy in ("zero1", "zero2"):
        # The sharded optimizer reduce-scatters and frees gradients inside backward, before a GradScaler
        # could unscale them and check them for inf/nan: loss scaling cannot be applied correctly.
        raise ConfigError(
            f"--precision fp16 does not work with strategy {strategy!r} (its gradients are sharded "
            "and freed before loss scaling can unscale them). Use --precision bf16."
        )
    if cfg.train.precision == "fp16" and not uses_cuda:
        raise ConfigError(
            "--precision fp16 needs a CUDA GPU (fp16 loss scaling is not supported on CPU). "
            "Use --precision bf16, which autocasts on CPU too, or fp32."
        )


def _check_directories(cfg: RunConfig) -> None:
    for what, value in (("--ckpt-dir", cfg.checkpoint.dir), ("--run-dir", cfg.train.run_dir)):
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise ConfigError(f"{what} {value!r} exists and is not a directory. Give a directory path.")


def _check_batch(cfg: RunConfig, train_samples: int, dp: int, topo: Topology, strategy: str) -> None:
    """The global batch fits the data and splits into non-empty per-rank, accumulation and pipeline
    micro-batches; ``--compile`` is not combined with tensor parallelism."""
    t = cfg.train
    if train_samples < t.batch_size:
        raise ConfigError(
            f"the training split of {cfg.data.name!r} has {train_samples} samples, fewer than one global "
            f"batch of {t.batch_size}. Use a smaller --batch-size."
        )
    if t.batch_size // (dp * t.grad_accum) < 1:
        raise ConfigError("the per-rank micro-batch would be empty; raise --batch-size or lower --grad-accum")
    micro = t.batch_size // (dp * t.grad_accum)
    if t.compile and topo.tp > 1:
        # torch 2.13: the backward of a torch.compile'd block under the DTensor TP plan hands a plain tensor to
        # DTensor's Redistribute backward ("'Tensor' object has no attribute '_local_tensor'"), after launch.
        raise ConfigError(
            f"--compile does not work with tensor parallelism yet (strategy {strategy!r}, tp {topo.tp}): "
            "the compiled blocks' backward fails on DTensor gradients. Drop --compile, or use a strategy "
            "without tp (ddp, zero3, pp, fsdp+pp)."
        )
    microbatches = cfg.strategy.microbatches or topo.pp
    if topo.pp > 1 and micro % microbatches:
        raise ConfigError(
            f"--microbatches {microbatches} does not divide the per-rank batch {micro} (global batch "
            f"{t.batch_size} / {dp} data-parallel ranks / grad_accum {t.grad_accum}). Choose "
            f"--microbatches among the divisors of {micro}, or a --batch-size that splits evenly."
        )


def _meta_model(cfg: RunConfig, data: Splits) -> nn.Module:
    """The model on the meta device (no memory), checked against the data; feature warnings printed."""
    import torch

    from paratrain.models import build_model
    from paratrain.parallel.parallelize import preflight_features

    try:
        with torch.device("meta"):
            meta_model = build_model(cfg.model, data.input_shape, data.num_outputs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_language_model(cfg.model.name, meta_model, data.input_shape)
    for warning in preflight_features(cfg, meta_model):
        print(f"paratrain: warning: {warning}", file=sys.stderr)
    return meta_model


def use_model_tokenizer(cfg: RunConfig) -> None:
    """``--model hf:DIR`` with ``data.tokenizer`` left at ``byte``: tokenize with the model's own
    ``DIR/tokenizer.json`` (and its BOS/EOS), when it has one."""
    name = cfg.model.name
    if name.startswith("hf:") and cfg.data.tokenizer == "byte":
        d = Path(name[3:]).expanduser()
        if (d / "tokenizer.json").is_file():
            cfg.data.tokenizer = f"hf:{d}"
        elif any((d / f).is_file() for f in ("tokenizer.model", "vocab.json", "tokenizer_config.json")):
            print(
                f"paratrain: warning: {d} has tokenizer files but no tokenizer.json (the fast tokenizer paratrain "
                "reads), so the data is tokenized by bytes, not by the model's tokenizer. Save it once with "
                "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR).",
                file=sys.stderr,
            )


def check_model_fits_data(model: str, dataset: str, task: str, input_shape: tuple[int, ...]) -> None:
    """A language model needs a text dataset (token ids) and the other models need tensor data; images for
    cnn/resnet. Raises :class:`ConfigError` with one line, instead of a dtype error inside the workers."""
    from paratrain.models import is_language_model, is_user_model

    if is_user_model(model):  # a user's factory declares nothing: its forward pass is the check
        return
    if is_language_model(model) and task != "lm":
        raise ConfigError(
            f"model {model!r} is a language model and needs a text dataset, but {dataset!r} holds {task} "
            "tensors. Use --data python-stdlib or --data text:PATH, or a tensor model (--model mlp, cnn, "
            "resnet18) for this dataset."
        )
    if not is_language_model(model) and task == "lm":
        raise ConfigError(
            f"model {model!r} takes tensor data, but {dataset!r} is a text dataset (token ids). Use a Llama "
            "model (--model llama-debug, llama-small) for text, or tensor data for this model (--data digits, "
            "mnist, cifar10, synthetic-classification)."
        )
    if (model == "cnn" or model.startswith("resnet")) and len(input_shape) != 3:
        raise ConfigError(
            f"model {model!r} needs image inputs (C, H, W), but {dataset!r} has inputs of shape "
            f"{tuple(input_shape)}. Use --model mlp for it, or image data (--data digits, mnist, cifar10)."
        )


def check_language_model(name: str, meta_model: Any, input_shape: tuple[int, ...]) -> None:
    """On the meta model, what a Llama model would otherwise refuse inside every worker: a shape-only preset
    (``llama2-7b``, ...) and sequences longer than its rotary table (``model.max_seq_len``)."""
    from paratrain.models.llama import Llama, check_trainable

    positions = getattr(getattr(meta_model, "config", None), "n_positions", None)  # GPT-2's learned positions
    if name.startswith("hf:") and isinstance(positions, int) and input_shape[0] > positions:
        raise ConfigError(
            f"--seq-len {input_shape[0]} exceeds the {positions} learned positions of {name} (n_positions in its "
            f"config.json). Use --seq-len {positions} or less."
        )
    if not isinstance(meta_model, Llama):
        return
    check_trainable(name, meta_model.config)
    seq, limit = input_shape[0], meta_model.config.max_seq_len
    if seq > limit:
        raise ConfigError(
            f"--seq-len {seq} exceeds model.max_seq_len={limit} (the rotary table's length). Raise it with "
            f"--set model.max_seq_len={seq} (or more), or use --seq-len {limit} or less."
        )


def preflight_run_dir(run_dir: Path) -> None:
    """Create the run directory and prove it writable (a probe file), or fail naming it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"the run directory {run_dir} is not writable ({e.strerror or e}). Give a writable --run-dir."
        ) from None


def start_new_metrics(run_dir: Path, cfg: RunConfig) -> None:
    """``--resume never`` in a used run directory starts a new ``metrics.jsonl``: the old one is kept as
    ``metrics-<time it was last written>.jsonl`` (``paratrain plot`` would draw two runs as one curve)."""
    old = run_dir / "metrics.jsonl"
    if cfg.checkpoint.resume == "never" and old.is_file() and old.stat().st_size:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(old.stat().st_mtime))
        os.replace(old, run_dir / f"metrics-{stamp}.jsonl")


def default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.strategy.name.replace('+', '_')}-{uuid.uuid4().hex[:6]}"


def run_training(cfg: RunConfig, quiet: bool = False) -> dict[str, Any]:
    """Check, launch the workers, and return the run's summary. Raises :class:`ConfigError` on bad input
    and :class:`LaunchError` when the workers fail."""
    run_dir = Path(cfg.train.run_dir) if cfg.train.run_dir else default_run_dir(cfg)
    if cfg.data.cache_dir is None:  # a trained tokenizer is cached next to the run, trained once (preflight)
        cfg.data.cache_dir = str(run_dir)
    world = preflight_run(cfg)
    run_dir = Path(cfg.train.run_dir) if cfg.train.run_dir else run_dir  # multi-node: runs/<rdzv-id>
    created = not run_dir.exists()
    preflight_run_dir(run_dir)
    cfg.train.run_dir = str(run_dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    try:
        preflight_checkpoint_dir(ckpt_dir)  # a read-only or unusable directory fails now, not after training
    except ConfigError:
        if created:  # refused before anything ran: leave no empty run directory behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    start_new_metrics(run_dir, cfg)
    # One writer per checkpoint directory: the lock is held by this process for the whole run (node 0 of a
    # multi-node job); the workers name their temporary files after the same job id.
    job_id = os.environ.setdefault(
        "PARATRAIN_JOB_ID", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    )
    lock = acquire_checkpoint_lock(ckpt_dir, job_id) if cfg.launch.node_rank == 0 else None
    # A restart (--max-restarts) resumes from the checkpoints committed after this (train/lifecycle.py).
    os.environ["PARATRAIN_JOB_START"] = repr(time.time())
    config_path = run_dir / "config.json"
    if cfg.train.progress is None:
        # Workers write through the elastic agent's log relay, so their own stderr is never a terminal:
        # the launching process decides whether a person is watching.
        cfg.train.progress = sys.stderr.isatty()
    config_path.write_text(cfg.to_json())
    summary_path = run_dir / "summary.json"
    summary_path.unlink(missing_ok=True)
    if not quiet:
        print(
            f"paratrain: {cfg.model.name} on {cfg.data.name}, strategy {cfg.strategy.name}, "
            f"{world} process(es), run dir {run_dir}",
            file=sys.stderr,
        )
    started = time.perf_counter()
    try:
        run_module("paratrain.train.worker", [str(config_path)], cfg.launch)
    finally:
        if lock is not None:
            lock.release()
    if not summary_path.is_file() and cfg.launch.nnodes != "1" and not wait_for_summary(summary_path):
        return {}  # another node ran rank 0: it prints the summary
    if not summary_path.is_file():
        raise LaunchError("the workers exited without writing a summary")
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    if os.environ.get("PARATRAIN_PREDICTED_PEAK"):  # set by the planner's guard (PREFLIGHT_CHECKS)
        summary["predicted_peak_bytes_per_rank"] = int(os.environ["PARATRAIN_PREDICTED_PEAK"])
    summary["wall_time_s"] = time.perf_counter() - started  # launch to exit, start-up included
    return summary
