"""The config sections of the training loop, checkpoints and the launcher: one dataclass each, a
docstring under every field, checks in ``__post_init__``."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.fields import (
    BOTH,
    TRACKERS,
    ac_policy,
    check_choice,
    check_choices,
    check_positive,
    option,
)
from paratrain.errors import ConfigError


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
                check_choice("train", "tracker", n, TRACKERS)
            self.tracker = ",".join(dict.fromkeys(names)) or None
        if self.profile is not None:
            start, _, end = self.profile.partition(":")
            if not (start.isdigit() and end.isdigit() and 1 <= int(start) <= int(end)):
                raise ConfigError(f"train.profile={self.profile!r}: write START:END, the first and last "
                                  "optimizer steps to profile, with 1 <= START <= END (e.g. --profile 5:8).")  # fmt: skip
            if self.steps is not None and int(start) > self.steps:
                raise ConfigError(f"--profile {self.profile}: the run has only {self.steps} steps (--steps); "
                                  f"profile steps within 1..{self.steps}.")  # fmt: skip
        check_positive("train", "batch_size", self.batch_size)
        check_positive("train", "steps", self.steps, allow_none=True)
        check_positive("train", "epochs", self.epochs, allow_none=True)
        check_positive("train", "grad_accum", self.grad_accum)
        check_positive("train", "log_every", self.log_every, allow_none=True)
        if self.eval_batches is not None and self.eval_batches < 0:
            raise ConfigError(
                f"train.eval_batches must be >= 0 (0: the whole test split), got {self.eval_batches!r}."
            )
        check_choices(self, "train")
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
        check_positive("checkpoint", "keep_last", self.keep_last, allow_none=True)
        if self.resume.strip() == "":
            raise ConfigError("checkpoint.resume is empty: use auto, never, or the path of a step directory.")


@dataclass
class LaunchConfig:
    nproc_per_node: int | None = option(None, aliases=("--nproc_per_node",), scope=BOTH)
    """Worker processes on this node. Default: one per GPU when GPUs are present, else 2."""
    nnodes: str = option("1", scope=BOTH, metavar="N|MIN:MAX")
    """Number of nodes, or an elastic range ``MIN:MAX``."""
    node_rank: int = option(0, aliases=("--node_rank",), scope=BOTH)
    """Rank of this node (static multi-node rendezvous)."""
    rdzv_endpoint: str | None = option(None, aliases=("--rdzv_endpoint",), scope=BOTH, metavar="HOST:PORT")
    """``HOST:PORT`` of the rendezvous. Default: ``127.0.0.1`` on a free port (single node)."""
    rdzv_backend: str = option("c10d", aliases=("--rdzv_backend",), scope=BOTH, choices=("c10d", "static"))
    """Rendezvous backend of the elastic agent."""
    rdzv_id: str | None = option(None, aliases=("--rdzv_id",), scope=BOTH)
    """Job id shared by all nodes of one job."""
    rdzv_conf: str | None = option(None, aliases=("--rdzv_conf",), scope=BOTH, metavar="KEY=VALUE,...")
    """torchrun's ``--rdzv-conf``: ``key=value,...`` for the c10d rendezvous, e.g. ``last_call_timeout=5,
    keep_alive_interval=1`` (see docs/launch.md for the keys)."""
    master_port: int | None = option(None, aliases=("--master_port",), scope=BOTH)
    """Explicit port for the single-node rendezvous on 127.0.0.1 (checked to be free before starting)."""
    max_restarts: int = option(0, aliases=("--max_restarts",), scope=BOTH)
    """Times the elastic agent restarts the worker group after a failure."""
    backend: str = option("auto", choices=("auto", "gloo", "nccl"))
    """Process-group backend: ``auto`` (NCCL with CUDA, else Gloo), ``gloo`` or ``nccl``."""
    timeout_s: float = option(300.0, flag="--timeout")
    """Process-group timeout in seconds: a collective waiting longer fails, naming what it waited for."""
    device: str = option("auto", scope=BOTH, choices=("auto", "cpu", "cuda"))
    """``auto`` (CUDA when present), ``cpu`` or ``cuda``. Under ``launch`` the script picks its own device;
    there ``cpu`` only lifts the one-process-per-GPU check (and the default of one worker per GPU)."""
    cpu_bind: str = option("none", scope=BOTH, choices=("none", "cores"))
    """``cores``: pin each worker to its own equal block of the cores the launcher may use (its CPU affinity,
    so a Slurm cpuset or ``taskset`` holds), local rank r on block r, with ``OMP_NUM_THREADS`` the block's
    size unless set; with more workers than cores, local rank r on core ``r mod cores``. Linux only.
    ``none``: the OS places the workers."""
    fail_at_step: int | None = option(None)
    """Fault injection: rank ``fail_rank`` SIGKILLs itself after this optimizer step, on the first attempt only."""
    fail_rank: int = option(0)
    """The rank that ``fail_at_step`` kills."""

    def __post_init__(self) -> None:
        check_positive("launch", "nproc_per_node", self.nproc_per_node, allow_none=True)
        check_positive("launch", "fail_at_step", self.fail_at_step, allow_none=True)
        if self.fail_rank < 0:
            raise ConfigError(f"launch.fail_rank must be >= 0, got {self.fail_rank!r}.")
        if self.node_rank < 0:
            raise ConfigError(f"launch.node_rank must be >= 0, got {self.node_rank!r}.")
        check_choices(self, "launch")
        check_positive("launch", "timeout_s", self.timeout_s)
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
