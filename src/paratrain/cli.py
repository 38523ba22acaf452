"""``paratrain`` command line: parse, build a typed config, call one function. Nothing else lives here."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

__version__ = "0.1.0"
from paratrain.config import ConfigError, RunConfig

# flag -> (section.key, type); applied as overrides on top of --config, before --set
_TRAIN_FLAGS: dict[str, tuple[str, type]] = {
    "model": ("model.name", str),
    "data": ("data.name", str),
    "strategy": ("strategy.name", str),
    "nproc_per_node": ("launch.nproc_per_node", int),
    "steps": ("train.steps", int),
    "epochs": ("train.epochs", int),
    "batch_size": ("train.batch_size", int),
    "grad_accum": ("train.grad_accum", int),
    "precision": ("train.precision", str),
    "sync_batchnorm": ("train.sync_batchnorm", bool),
    "activation_checkpointing": ("train.activation_checkpointing", bool),
    "comm_algorithm": ("strategy.comm_algorithm", str),
    "shard_size": ("strategy.shard_size", int),
    "offload": ("strategy.offload", bool),
    "lr": ("optimizer.lr", float),
    "optimizer": ("optimizer.name", str),
    "seed": ("train.seed", int),
    "run_dir": ("train.run_dir", str),
    "ckpt_dir": ("checkpoint.dir", str),
    "ckpt_every": ("checkpoint.every", int),
    "resume": ("checkpoint.resume", str),
    "master_port": ("launch.master_port", int),
    "max_restarts": ("launch.max_restarts", int),
    "backend": ("launch.backend", str),
    "device": ("launch.device", str),
    "timeout": ("launch.timeout_s", float),
    "keep_last": ("checkpoint.keep_last", int),
    "async_checkpoint": ("checkpoint.async_save", bool),
    "fail_at_step": ("launch.fail_at_step", int),
    "fail_rank": ("launch.fail_rank", int),
    "nnodes": ("launch.nnodes", str),
    "node_rank": ("launch.node_rank", int),
    "rdzv_endpoint": ("launch.rdzv_endpoint", str),
    "rdzv_id": ("launch.rdzv_id", str),
    "rdzv_conf": ("launch.rdzv_conf", str),
}


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="TOML file with [model], [data], [strategy], [optimizer], [train], ... tables"
    )
    p.add_argument("--model", help="model name (mlp, cnn, ...); default cnn")
    p.add_argument("--data", help="dataset: digits, synthetic-classification, synthetic-regression, NAME:DIR")
    p.add_argument("--strategy", help="parallel strategy (see `paratrain strategies`); default ddp")
    p.add_argument("--nproc-per-node", type=int, help="worker processes (default: one per GPU, else 2)")
    p.add_argument("--steps", type=int, help="optimizer steps (overrides --epochs)")
    p.add_argument("--epochs", type=int, help="passes over the training split (default 8)")
    p.add_argument("--batch-size", type=int, help="GLOBAL batch size, summed over ranks (default 64)")
    p.add_argument("--grad-accum", type=int, help="micro-batches accumulated per optimizer step")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="numeric precision (default fp32)")
    p.add_argument(
        "--sync-batchnorm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SyncBatchNorm across data-parallel ranks (default: on for BatchNorm models when the per-rank batch < 16)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        default=None,
        help="recompute each model block's activations in backward (less memory, more compute)",
    )
    p.add_argument(
        "--comm-algorithm",
        choices=["native", "ring", "tree", "naive", "rhd"],
        help="all-reduce of --strategy dp (default native)",
    )
    p.add_argument("--shard-size", type=int, help="hsdp: ranks per shard group; must divide the world size")
    p.add_argument(
        "--offload",
        action="store_true",
        default=None,
        help="zero3/hsdp: keep sharded parameters, gradients and optimizer state on the CPU",
    )
    p.add_argument("--lr", type=float, help="learning rate")
    p.add_argument("--optimizer", choices=["adamw", "sgd"], help="optimizer (default adamw)")
    p.add_argument("--seed", type=int, help="seed for every RNG (default 0)")
    p.add_argument("--run-dir", help="metrics/config/summary directory (default runs/<time>-<strategy>)")
    p.add_argument("--ckpt-dir", help="checkpoint directory (default <run-dir>/checkpoints)")
    p.add_argument("--ckpt-every", type=int, help="save every N steps (default: only at the end)")
    p.add_argument("--resume", help="auto (default): resume from DIR/latest if present; never; or a step dir")
    p.add_argument(
        "--master-port", type=int, help="explicit rendezvous port on 127.0.0.1 (default: a free one)"
    )
    p.add_argument("--max-restarts", type=int, help="restarts of the worker group by the elastic agent")
    p.add_argument("--backend", choices=["auto", "gloo", "nccl"], help="process-group backend (default auto)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="device (default auto)")
    p.add_argument("--timeout", type=float, help="process-group timeout in seconds (default 300)")
    p.add_argument("--keep-last", type=int, help="keep only the newest K valid checkpoints")
    p.add_argument(
        "--async-checkpoint",
        action="store_true",
        default=None,
        help="write checkpoints in the background (training blocks only for the copy to CPU)",
    )
    p.add_argument(
        "--fail-at-step", type=int, help="fault injection: SIGKILL --fail-rank after step S (first attempt)"
    )
    p.add_argument("--fail-rank", type=int, help="the rank --fail-at-step kills (default 0)")
    p.add_argument("--nnodes", help="nodes N, or an elastic range MIN:MAX (needs --rdzv-endpoint)")
    p.add_argument("--node-rank", type=int, help="rank of this node (multi-node)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the multi-node rendezvous (private network only)")
    p.add_argument("--rdzv-id", help="job id shared by all nodes of one job")
    p.add_argument(
        "--rdzv-conf",
        help="rendezvous settings KEY=VALUE,... (torchrun's --rdzv-conf), e.g. "
        "last_call_timeout=5,keep_alive_interval=1",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="set any config field, e.g. --set optimizer.weight_decay=0.01 (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object (last line)")


def build_config(args: argparse.Namespace) -> RunConfig:
    cfg = RunConfig.from_toml(args.config) if args.config else RunConfig()
    sets = []
    for flag, (key, _tp) in _TRAIN_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            sets.append(f"{key}={value}")
    if args.steps is not None:
        sets.append("train.epochs=none")
    cfg = cfg.override(sets + list(args.set))
    if cfg.strategy.name == "single" and cfg.launch.nproc_per_node is None:
        cfg.launch.nproc_per_node = 1
    from paratrain.launch import resolve

    cfg.launch = resolve(cfg.launch)  # inside a multi-node Slurm allocation: nodes, endpoint, id
    return cfg


def preflight(cfg: RunConfig) -> int:
    """Every check that can fail before a process starts. Returns the world size."""
    import torch

    from paratrain.data import build_dataset
    from paratrain.launch import gpu_count, resolve_nproc
    from paratrain.launch import preflight as launch_preflight
    from paratrain.models import build_model
    from paratrain.parallel import check_strategy, get_strategy

    launch_preflight(cfg.launch)
    nnodes = int(cfg.launch.nnodes.split(":")[0])
    world = resolve_nproc(cfg.launch) * nnodes
    strategy = get_strategy(cfg.strategy.name)
    check_strategy(strategy, world, cfg.strategy)
    cfg.validate(world, strategy.data_parallel_size(world, cfg.strategy))
    if cfg.train.precision == "fp16" and strategy.name in ("zero1", "zero2"):
        # The sharded optimizer reduce-scatters and frees gradients inside backward, before a GradScaler
        # could unscale them and check them for inf/nan: loss scaling cannot be applied correctly.
        raise ConfigError(
            f"--precision fp16 does not work with strategy {strategy.name!r} (its gradients are sharded "
            "and freed before loss scaling can unscale them). Use --precision bf16."
        )
    uses_cuda = cfg.launch.device == "cuda" or (cfg.launch.device == "auto" and gpu_count() > 0)
    if cfg.train.precision == "fp16" and not uses_cuda:
        raise ConfigError(
            "--precision fp16 needs a CUDA GPU (fp16 loss scaling is not supported on CPU). "
            "Use --precision bf16, which autocasts on CPU too, or fp32."
        )
    for what, value in (("--ckpt-dir", cfg.checkpoint.dir), ("--run-dir", cfg.train.run_dir)):
        if value is not None and Path(value).exists() and not Path(value).is_dir():
            raise ConfigError(f"{what} {value!r} exists and is not a directory. Give a directory path.")
    data = build_dataset(cfg.data)
    dp = strategy.data_parallel_size(world, cfg.strategy)
    if len(data.train) < cfg.train.batch_size:
        raise ConfigError(
            f"the training split of {cfg.data.name!r} has {len(data.train)} samples, fewer than one global "
            f"batch of {cfg.train.batch_size}. Use a smaller --batch-size."
        )
    if cfg.train.batch_size // (dp * cfg.train.grad_accum) < 1:
        raise ConfigError("the per-rank micro-batch would be empty; raise --batch-size or lower --grad-accum")
    try:
        with torch.device("meta"):
            meta_model = build_model(cfg.model, data.input_shape, data.num_outputs)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from paratrain.train.features import preflight_features

    for warning in preflight_features(cfg, meta_model):
        print(f"paratrain: warning: {warning}", file=sys.stderr)
    from paratrain.checkpoint.inspect import preflight_resume
    from paratrain.launch import preflight_train

    preflight_train(cfg, world, strategy)  # elastic ranges, fault-injection rank, multi-node run dir
    preflight_resume(cfg, meta_model, cfg.train.run_dir)  # a checkpoint of another model fails here
    return world


def _default_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.strategy.name.replace('+', '_')}-{uuid.uuid4().hex[:6]}"


def cmd_train(args: argparse.Namespace) -> int:
    from paratrain.launch import LaunchError, run_module

    cfg = build_config(args)
    world = preflight(cfg)
    run_dir = Path(cfg.train.run_dir) if cfg.train.run_dir else _default_run_dir(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.train.run_dir = str(run_dir)
    config_path = run_dir / "config.json"
    if cfg.train.progress is None:
        # Workers write through the elastic agent's log relay, so their own stderr is never a terminal:
        # the launching process decides whether a person is watching.
        cfg.train.progress = sys.stderr.isatty()
    config_path.write_text(cfg.to_json())
    summary_path = run_dir / "summary.json"
    summary_path.unlink(missing_ok=True)
    if not args.json:
        print(
            f"paratrain: {cfg.model.name} on {cfg.data.name}, strategy {cfg.strategy.name}, "
            f"{world} process(es), run dir {run_dir}",
            file=sys.stderr,
        )
    try:
        run_module("paratrain.worker", [str(config_path)], cfg.launch)
    except LaunchError as e:
        print(f"paratrain train: {e}", file=sys.stderr)
        return 1
    if not summary_path.is_file() and cfg.launch.nnodes != "1":
        from paratrain.launch import wait_for_summary

        if not wait_for_summary(summary_path):
            print(
                "paratrain train: this node's workers finished; the node that ran rank 0 prints the summary",
                file=sys.stderr,
            )
            return 0
    if not summary_path.is_file():
        print("paratrain train: the workers exited without writing a summary", file=sys.stderr)
        return 1
    summary = json.loads(summary_path.read_text())
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    acc = s.get("eval_accuracy")
    sps = s.get("samples_per_s")
    rows = [
        ("strategy", f"{s['strategy']} x {s['world_size']} ({s.get('device')}, {s.get('backend')})"),
        ("parameters", f"{s['num_params']:,}"),
        (
            "steps",
            f"{s['steps']}"
            + (f" (resumed from {s['resumed_from_step']})" if s.get("resumed_from_step") else ""),
        ),
        ("final loss", f"{s['final_loss']:.4f}" if s.get("final_loss") is not None else "n/a"),
        ("eval accuracy", f"{acc:.2%}" if acc is not None else "n/a"),
        ("eval loss", f"{s['eval_loss']:.4f}" if s.get("eval_loss") is not None else "n/a"),
        ("throughput", f"{sps:,.0f} samples/s" if sps else "n/a"),
        ("model state / rank", f"{s['model_state_bytes_per_rank'] / 2**20:.2f} MiB"),
        ("checkpoint", str(s.get("checkpoint"))),
        ("param sha256", str(s.get("param_sha256"))[:16] + "..."),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:>{width}}  {v}")


def cmd_strategies(args: argparse.Namespace) -> int:
    from paratrain.parallel import _ALIASES, available_strategies, get_strategy

    names = available_strategies(include_aliases=False)
    if args.json:
        print(
            json.dumps(
                {n: get_strategy(n).description for n in names}
                | {a: f"alias of {t}" for a, t in _ALIASES.items()}
            )
        )
        return 0
    for n in names:
        print(f"{n:10s} {get_strategy(n).description}")
    for a, t in sorted(_ALIASES.items()):
        print(f"{a:10s} alias of {t}")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from paratrain.config import LaunchConfig
    from paratrain.launch import LaunchError, run_module, run_script

    if args.slurm:
        from paratrain.slurm import sbatch_script

        command = (["-m"] if args.module else []) + [args.script, *args.script_args]
        print(
            sbatch_script(
                args.nodes,
                args.gpus_per_node,
                command,
                time_limit=args.time,
                max_restarts=args.max_restarts or 3,
            ),
            end="",
        )
        return 0
    launch = LaunchConfig(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend=args.rdzv_backend,
        rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
    )
    try:
        if args.module:
            run_module(args.script, args.script_args, launch)
        else:
            run_script(args.script, args.script_args, launch)
    except LaunchError as e:
        print(f"paratrain launch: {e}", file=sys.stderr)
        return 1
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain", description="Distributed PyTorch training, correct by construction."
    )
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model (default: CNN on digits, ddp over 2 local processes)")
    _add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("strategies", help="list the registered parallel strategies")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_strategies)

    p = sub.add_parser(
        "launch", help="run any script on N local ranks with the torch elastic agent (torchrun drop-in)"
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None)
    p.add_argument("--nnodes", default="1")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None)
    p.add_argument("--rdzv-backend", "--rdzv_backend", default="c10d")
    p.add_argument("--rdzv-id", "--rdzv_id", default=None)
    p.add_argument("--rdzv-conf", "--rdzv_conf", default=None)
    p.add_argument("--master-port", "--master_port", type=int, default=None)
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0)
    p.add_argument(
        "--standalone", action="store_true", help="accepted for torchrun compatibility (the default)"
    )
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module (python -m)")
    p.add_argument(
        "--slurm", action="store_true", help="print an sbatch script for --nodes x --gpus-per-node, then exit"
    )
    p.add_argument("--nodes", type=int, default=2, help="--slurm: number of nodes (default 2)")
    p.add_argument(
        "--gpus-per-node", type=int, default=8, help="--slurm: GPUs (= workers) per node (default 8)"
    )
    p.add_argument("--time", default="01:00:00", help="--slurm: time limit (default 01:00:00)")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    p.set_defaults(func=cmd_launch)

    from paratrain.checkpoint.commands import add_ckpt_commands

    add_ckpt_commands(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _add_bench_comm(bench_sub)
    return parser


def _add_bench_comm(bench_sub: Any) -> None:
    try:
        from paratrain.comm import bench as comm_bench
    except ImportError:  # pragma: no cover - comm not built yet
        return
    p = bench_sub.add_parser(
        "comm", help="time collectives (native and paratrain's algorithms) over message sizes"
    )
    comm_bench.add_arguments(p)
    p.set_defaults(func=comm_bench.main)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"paratrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
