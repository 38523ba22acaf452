"""``paratrain`` command line: parse, build a typed config, call one function. Nothing else lives here.

Every flag of ``train``, ``launch``, ``plan``, ``generate`` and ``bench`` that sets a config value is generated
from the typed config dataclasses (:func:`paratrain.config.add_arguments` for a run's sections,
:func:`paratrain.config.add_command_arguments` for a command's own config), with the field docstrings as help:
each option is declared once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn

from paratrain import __version__
from paratrain.config import (
    LAUNCH,
    TRAIN,
    GenerateConfig,
    LaunchConfig,
    RunConfig,
    add_arguments,
    add_command_arguments,
    add_set_argument,
    apply_arguments,
    command_config,
    set_values,
)
from paratrain.errors import ConfigError
from paratrain.tables import Col, key_values, table


def build_config(args: argparse.Namespace) -> RunConfig:
    """``--config`` file, then the flags, then ``--set``; inside a Slurm allocation, its values."""
    from paratrain.launch import resolve

    cfg = RunConfig.from_toml(args.config) if args.config else RunConfig()
    cfg = apply_arguments(cfg, args, TRAIN).override(set_values(args))
    if cfg.strategy.name == "single" and cfg.launch.nproc_per_node is None:
        cfg.launch.nproc_per_node = 1
    cfg.launch = resolve(cfg.launch)  # inside a multi-node Slurm allocation: nodes, endpoint, id
    return cfg


def early_checks(cfg: RunConfig) -> None:
    """The refusals that need no torch, before anything imports it (a typo is answered in well under a
    second): the strategy, model and dataset names, a dataset path or run directory that cannot be, and,
    when the world size is known without asking for GPUs (``--nproc-per-node`` or ``--device cpu``, a fixed
    ``--nnodes``), the strategy's degrees and the batch split."""
    from paratrain.spec import strategies as specs
    from paratrain.spec.capabilities import check_model_axes
    from paratrain.spec.catalog import check_names
    from paratrain.spec.refusals import check, check_optimizer_kernel

    name = specs.canonical(cfg.strategy.name)
    check_names(cfg.model.name, cfg.data.name, cfg.data.path)
    for what, value in (("--ckpt-dir", cfg.checkpoint.dir), ("--run-dir", cfg.train.run_dir)):
        if value is not None and os.path.exists(value) and not os.path.isdir(value):
            raise ConfigError(f"{what} {value!r} exists and is not a directory. Give a directory path.")
    launch = cfg.launch
    nproc = launch.nproc_per_node or (2 if launch.device == "cpu" else None)
    if nproc is None or ":" in launch.nnodes or not launch.nnodes.isdigit():
        return
    world = nproc * int(launch.nnodes)
    topology = check(name, world, cfg.strategy, nproc)
    check_model_axes(cfg.model.name, cfg.model.n_experts, topology)
    check_optimizer_kernel(name, topology, cfg.optimizer.name, cfg.optimizer.implementation)
    cfg.validate(world, topology.dp_size)


def cmd_train(args: argparse.Namespace) -> int:
    cfg = build_config(args)
    early_checks(cfg)
    from paratrain.diagnose.doctor_net import preflight_ifname

    preflight_ifname()  # a GLOO_SOCKET_IFNAME Gloo cannot use: doctor's diagnosis, before launch

    from paratrain.launch import LaunchError
    from paratrain.launch.train_job import run_training
    from paratrain.plan.guard import register

    register()  # the planner checks the run fits the device before any worker starts (--no-plan-check)
    try:
        summary = run_training(cfg, quiet=args.json)
    except LaunchError as e:
        print(f"paratrain train: {e}", file=sys.stderr)
        return e.exit_code
    if not summary:
        print("paratrain train: this node's workers finished; the node that ran rank 0 prints the summary",
              file=sys.stderr)  # fmt: skip
    elif args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    return 0


def _print_summary(s: dict[str, Any]) -> None:
    acc, sps, tps = s.get("eval_accuracy"), s.get("samples_per_s"), s.get("tokens_per_s")
    ppl = s.get("eval_perplexity")
    rows = [
        ("strategy", f"{s['strategy']} x {s['world_size']} ({s.get('device')}, {s.get('backend')})"),
        ("parameters", f"{s['num_params']:,}"),
        ("steps", f"{s['steps']}"
         + (f" (resumed from {s['resumed_from_step']})" if s.get("resumed_from_step") else "")),
        ("final loss", f"{s['final_loss']:.4f}" if s.get("final_loss") is not None else "n/a"),
        ("eval accuracy", f"{acc:.2%}" if acc is not None else "n/a"),
        ("eval loss", f"{s['eval_loss']:.4f}" if s.get("eval_loss") is not None else "n/a"),
        ("throughput", f"{sps:,.0f} samples/s" if sps else "n/a"),
        ("model state / rank", f"{s['model_state_bytes_per_rank'] / 2**20:.2f} MiB (at rest)"),
        ("checkpoint", str(s.get("checkpoint"))),
        ("param sha256", str(s.get("param_sha256"))[:16] + "..."),
    ]  # fmt: skip
    rows[1:1] = _run_rows(s)
    if ppl is not None:
        rows.insert(9, ("eval perplexity", f"{ppl:.2f}"))
    if tps:
        rows.insert(-3, ("tokens/s", f"{tps:,.0f}"))
    if s.get("peak_bytes_per_rank"):
        rows.insert(-2, ("peak / rank", f"{s['peak_bytes_per_rank'] / 2**20:.2f} MiB (during a step)"))
    if s.get("predicted_peak_bytes_per_rank"):
        rows.insert(
            -2, ("predicted peak", f"{s['predicted_peak_bytes_per_rank'] / 2**20:.2f} MiB (paratrain plan)")
        )
    if s.get("cuda_peak_allocated_bytes_per_rank"):
        alloc, reserved = (
            s["cuda_peak_allocated_bytes_per_rank"],
            s.get("cuda_peak_reserved_bytes_per_rank") or 0,
        )
        rows.insert(
            -2, ("GPU peak / rank", f"{alloc / 2**20:.2f} MiB allocated, {reserved / 2**20:.2f} MiB reserved")
        )
    print("\n".join(key_values(rows, align=">", sep=2)))


def _run_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Summary rows of how the run ran: precision and collectives, wall and training time, restarts."""
    wall, train = s.get("wall_time_s"), s.get("train_time_s")
    times = [f"{wall:.1f} s wall" if wall is not None else "", f"{train:.1f} s training" if train else ""]
    return [
        ("precision / comm", f"{s.get('precision', 'n/a')}, {s.get('comm_algorithm', 'native')} collectives"),
        ("time", ", ".join(t for t in times if t) or "n/a"),
        ("restarts", str(s.get("restarts", 0))),
    ]


def cmd_strategies(args: argparse.Namespace) -> int:
    from paratrain.spec.strategies import ALIASES, STRATEGIES

    if args.json:
        print(json.dumps({n: s.description for n, s in sorted(STRATEGIES.items())}
                         | {a: f"alias of {t}" for a, t in ALIASES.items()}))  # fmt: skip
        return 0
    rows = [(n, spec.description) for n, spec in sorted(STRATEGIES.items())]
    rows += [(a, f"alias of {t}") for a, t in sorted(ALIASES.items())]
    print("\n".join(table([Col(width=12), Col()], rows, header=False)))
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    """``paratrain models`` / ``paratrain datasets`` (torch-free: spec/catalog.py)."""
    from paratrain.spec import catalog

    rows = catalog.models() if args.command == "models" else catalog.datasets()
    if args.json:
        print(json.dumps(dict(rows)))
        return 0
    print("\n".join(table([Col(width=26), Col()], rows, header=False)))
    flag = "--model" if args.command == "models" else "--data"
    print(f"\nyour own: {flag} pkg.module:factory (docs/python-api.md)")
    return 0


def cmd_launch(args: argparse.Namespace) -> int:
    from paratrain.diagnose.guard.launcher import resolve_guard_arguments
    from paratrain.launch import LaunchError, run_script, run_user_module

    resolve_guard_arguments(args)  # --hang-timeout without --guard: refused, not ignored
    if not args.slurm:  # (under --slurm the nodes' interfaces are not this host's)
        from paratrain.diagnose.doctor_net import preflight_ifname

        preflight_ifname()
    if args.slurm:
        from paratrain.config import cli_options
        from paratrain.launch.slurm import sbatch_script, srun_flags

        command = (["-m"] if args.module else []) + [args.script, *args.script_args]
        given = {o.key: getattr(args, o.dest) for o in cli_options(LAUNCH, ["launch"])
                 if o.key != "max_restarts" and getattr(args, o.dest, None) is not None}  # fmt: skip
        guard = ["--guard", "--hang-timeout", str(args.hang_timeout), "--check-desync-every",
                 str(args.check_desync_every)] if args.guard else []  # fmt: skip
        print(sbatch_script(args.nodes, args.gpus_per_node, command, time_limit=args.time,
                            max_restarts=args.launch__max_restarts or 3,
                            flags=srun_flags(given, guard)), end="")  # fmt: skip
        return 0
    launch: LaunchConfig = apply_arguments(RunConfig(), args, LAUNCH).launch
    if args.guard:
        from paratrain.diagnose.guard.launcher import launch_guarded

        return launch_guarded(
            args.script,
            args.script_args,
            launch,
            args.hang_timeout,
            args.check_desync_every,
            module=args.module,
            json_summary=args.json,
        )
    try:
        if args.module:
            run_user_module(args.script, args.script_args, launch)
        else:
            run_script(args.script, args.script_args, launch)
    except LaunchError as e:
        print(f"paratrain launch: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    cfg = command_config(GenerateConfig, args)  # refused here, before torch is imported
    from pathlib import Path

    if cfg.ckpt is not None and not Path(cfg.ckpt).exists():  # before torch is imported
        raise ConfigError(
            f"--ckpt {cfg.ckpt} does not exist. Give a run directory, a checkpoint directory or a step."
        )
    from paratrain.train.generate import generate

    out = generate(cfg.ckpt, cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed, cfg.model,
                   kv_cache=cfg.kv_cache)  # fmt: skip
    print(json.dumps(out) if args.json else cfg.prompt + out["text"])
    if not args.json and out.get("tokens_per_s"):
        print(f"[paratrain] {out['new_tokens']} tokens at {out['tokens_per_s']:,.1f} tokens/s "
              f"({out['threads']} threads, KV cache {'on' if out['kv_cache'] else 'off'})", file=sys.stderr)  # fmt: skip
    return 0


# ---- the parser: one builder per command, run only for the command given ------------------------------
# Building a command's parser may import what the command needs (torch for most); `paratrain --help`,
# `paratrain lint`, `plan` and `strategies` build only their own, so they never pay torch's import time.


def _train(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", help="TOML file with [model], [data], [strategy], [optimizer], [train], ... tables"
    )
    add_arguments(p, TRAIN)
    add_set_argument(p)
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object (last line)")
    p.set_defaults(func=cmd_train)


def _strategies(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_strategies)


def _catalog(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print {name: description} as one JSON object")
    p.set_defaults(func=cmd_catalog)


def _launch(p: argparse.ArgumentParser) -> None:
    add_arguments(p, LAUNCH)
    p.add_argument(
        "--standalone", action="store_true", help="accepted for torchrun compatibility (the default)"
    )
    from paratrain.diagnose.guard.launcher import add_guard_arguments

    add_guard_arguments(p)
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


def _lint(p: argparse.ArgumentParser) -> None:
    from paratrain.lint import cli as lint_cli

    lint_cli.add_arguments(p)
    p.set_defaults(func=lint_cli.run)


def _doctor(p: argparse.ArgumentParser) -> None:
    from paratrain.diagnose import doctor

    doctor.add_arguments(p)
    p.set_defaults(func=doctor.run)


def _plan(p: argparse.ArgumentParser) -> None:
    from paratrain.plan import cli as plan_cli

    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)


def _generate(p: argparse.ArgumentParser) -> None:
    add_command_arguments(p, GenerateConfig)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(func=cmd_generate)


def _bench(p: argparse.ArgumentParser) -> None:
    from paratrain.bench import comm as comm_bench
    from paratrain.bench import scaling as scaling_bench

    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    b = bench_sub.add_parser(
        "comm", help="time collectives (native and paratrain's algorithms) over message sizes"
    )
    comm_bench.add_arguments(b)
    b.set_defaults(func=comm_bench.main)
    b = bench_sub.add_parser(
        "scaling", help="one training run per world size: samples/s, speed-up and efficiency (weak or strong)"
    )
    scaling_bench.add_arguments(b)
    b.set_defaults(func=scaling_bench.run)


def _plot(p: argparse.ArgumentParser) -> None:
    from paratrain.diagnose import plot

    plot.add_arguments(p)
    p.set_defaults(func=plot.run)


COMMANDS: dict[str, tuple[str, Any]] = {
    "train": ("train a model (default: CNN on digits, ddp over 2 local processes)", _train),
    "strategies": ("list the registered parallel strategies", _strategies),
    "models": ("list the models --model accepts by name (and how to bring your own)", _catalog),
    "datasets": ("list the datasets --data accepts by name (and how to bring your own)", _catalog),
    "launch": ("run any script on N local ranks with the torch elastic agent (torchrun drop-in)", _launch),
    "lint": ("static checks for distributed-training mistakes in any training script", _lint),
    "doctor": ("check the setup: versions, GPUs, network variables, a communication self-test", _doctor),
    "plan": ("memory, communication and step time of a model x strategy x cluster (no GPU)", _plan),
    "generate": ("sample text from a trained language-model checkpoint", _generate),
    "ckpt": ("inspect and export checkpoints", None),
    "bench": ("benchmarks", _bench),
    "plot": ("draw the loss, throughput, memory and profile of run directories", _plot),
}
"""``paratrain COMMAND``: help line and parser builder (``ckpt`` adds its own subcommands)."""


def _command_of(argv: list[str]) -> str | None:
    """The command named in ``argv`` (its first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


def make_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with full arguments for the command named in ``argv`` only (every command when ``argv``
    is ``None``); the others are listed with their help line."""
    parser = _Parser(prog="paratrain", description="Distributed PyTorch training, correct by construction.")
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _command_of(argv) if argv is not None else None
    for name, (helptext, build) in COMMANDS.items():
        full = argv is None or name == chosen
        if name == "ckpt":
            if full:
                from paratrain.checkpoint.commands import add_ckpt_commands

                add_ckpt_commands(sub)
            else:
                sub.add_parser(name, help=helptext)
            continue
        p = sub.add_parser(name, help=helptext)
        if full:
            build(p)
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are two lines (the error, and where the help is) instead of the
    whole usage of ``train``'s hundred flags, and also one JSON object on stdout when ``--json`` was given
    (``json_errors``, set by :func:`main`): a script reading the last line as JSON sees the refusal."""

    json_errors = False

    def error(self, message: str) -> NoReturn:
        if _Parser.json_errors:
            _print_json_refusal(f"{self.prog}: error: {message}")
        self.exit(2, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def _print_json_refusal(message: str) -> None:
    print(json.dumps({"error": message, "exit_code": 2}), flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    _Parser.json_errors = "--json" in argv
    parser = make_parser(argv)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        message = f"paratrain {args.command}: error: {e}"
        print(message, file=sys.stderr)
        if getattr(args, "json", False):
            _print_json_refusal(message)  # every --json command's refusal is JSON too (stdout, last line)
        return 2
    except KeyboardInterrupt:
        print(f"paratrain {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
