"""``paratrain bench scaling``: the same training run at several world sizes; samples/s, speed-up, efficiency.

    paratrain bench scaling --model mlp --steps 30                      # weak scaling at 1, 2, 4, ... ranks
    paratrain bench scaling --model mlp --steps 30 --nproc 1,2 --mode strong --batch-size 128
    paratrain bench scaling --strategy zero2 --nproc 1,2,4 --json --plot scaling.png

Every ``paratrain train`` flag passes through (``--model``, ``--strategy``, ``--steps``, ``--set ...``). For
each world size N in ``--nproc`` this process builds the run's config, launches the workers exactly as
``paratrain train`` does (:func:`paratrain.launch.train_job.run_training`, one run after the other) and
reads ``samples_per_s`` from the run's summary (training time only: no start-up, evaluation or save).

- **weak** scaling (default): ``--batch-size`` is the batch of one data-parallel rank; world size N trains
  a global batch of ``batch-size x dp(N)``, so the work per rank stays fixed;
- **strong** scaling: ``--batch-size`` is the global batch at every world size (it must divide evenly).

Speed-up S(N) = samples/s at N over samples/s at the smallest N0; efficiency = S(N) / (N / N0): 100% is
linear scaling. Rows with more ranks than CPU cores are marked: the ranks then share cores, and the
figures measure the scheduler as much as paratrain. Each world size's run directory is kept
(``--run-dir BASE`` -> ``BASE/n{N}``), so ``paratrain plot BASE/n*`` compares their curves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.config import (
    TRAIN,
    RunConfig,
    add_command_arguments,
    add_set_argument,
    apply_arguments,
    command_config,
    option,
    set_values,
)
from paratrain.config import add_arguments as add_config_arguments
from paratrain.errors import ConfigError
from paratrain.tables import Col, table


@dataclass(frozen=True)
class BenchScalingConfig:
    """``paratrain bench scaling``: the world sizes and how the work is split (every ``train`` flag too)."""

    nproc: str | None = option(None, metavar="N,N,...")
    """World sizes (local ranks) to run, e.g. 1,2,4 (default: 1, 2, 4, ... up to the number of CPU cores or
    GPUs, at least 1,2)."""
    mode: str = option("weak", choices=("weak", "strong"))
    """weak: --batch-size per data-parallel rank; strong: --batch-size is the global batch at every world
    size."""
    threads_per_rank: str = option("1", metavar="N|auto")
    """OpenMP threads of each rank (the same at every world size; auto: the launcher's cores // N). An
    OMP_NUM_THREADS in the environment wins."""
    plot: str | None = option(None, metavar="PNG")
    """Draw samples/s and efficiency against N."""

    def __post_init__(self) -> None:
        t = self.threads_per_rank
        if t != "auto" and not (t.isdigit() and int(t) >= 1):
            raise ConfigError(f"--threads-per-rank {t!r}: give a positive integer or auto.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``paratrain bench scaling``: its own, then every ``paratrain train`` flag."""
    add_command_arguments(parser, BenchScalingConfig)
    parser.add_argument("--json", action="store_true", help="print one JSON object (one row per world size)")
    parser.add_argument("--config", help="TOML file with the run's [model], [train], ... tables")
    add_set_argument(parser)
    add_config_arguments(parser, TRAIN)


def _world_sizes(text: str | None, devices: int) -> list[int]:
    if text is None:
        top, sizes = max(2, devices), [1]
        while sizes[-1] * 2 <= top:
            sizes.append(sizes[-1] * 2)
        return sizes
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(n < 1 for n in sizes):
        raise ConfigError(f"--nproc {text!r}: give world sizes as positive integers, e.g. --nproc 1,2,4.")
    return sorted(set(sizes))


def build_configs(args: argparse.Namespace) -> tuple[list[tuple[int, RunConfig]], dict[str, Any]]:
    """One validated config per world size, and what the report says about the workload."""
    from paratrain.launch.agent import gpu_count
    from paratrain.parallel import check_strategy, get_strategy

    if getattr(args, "launch__nproc_per_node", None) is not None:
        raise ConfigError(
            "bench scaling sets the ranks per run itself: give the world sizes with --nproc 1,2,4."
        )
    if getattr(args, "launch__nnodes", None) not in (None, "1"):
        raise ConfigError("bench scaling runs on one node: leave out --nnodes.")
    base = RunConfig.from_toml(args.config) if args.config else RunConfig()
    base.train.steps = 30  # a benchmark's default length; --steps or --epochs (alone) change it
    if getattr(args, "train__epochs", None) is not None and getattr(args, "train__steps", None) is None:
        base.train.steps = None
    base.checkpoint.save_at_end = False  # the runs measure training, not checkpoints
    base.checkpoint.resume = "never"
    base = apply_arguments(base, args, TRAIN).override(set_values(args))
    base.train.progress = False
    device = base.launch.device
    devices = gpu_count() if device != "cpu" else 0
    sizes = _world_sizes(args.nproc, devices or (os.cpu_count() or 1))
    if devices and max(sizes) > devices:
        raise ConfigError(f"--nproc {max(sizes)} but this machine has {devices} GPU(s); use at most {devices}, "
                          "or --set launch.device=cpu.")  # fmt: skip
    strategy = get_strategy(base.strategy.name)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = Path(base.train.run_dir) if base.train.run_dir else Path("runs") / f"{stamp}-scaling"
    per_rank = base.train.batch_size
    out = []
    for n in sizes:
        cfg = RunConfig.from_dict(base.to_dict())  # preflight writes resolved degrees into its config
        cfg.launch.nproc_per_node = n
        cfg.train.run_dir = str(root / f"n{n}")
        try:
            check_strategy(strategy, n, cfg.strategy)
            dp = strategy.data_parallel_size(n, cfg.strategy)
            if args.mode == "weak":
                cfg.train.batch_size = per_rank * dp
            cfg.validate(n, dp)
        except ConfigError as e:
            raise ConfigError(f"at world size {n}: {e}") from None
        out.append((n, cfg))
    info = {
        "mode": args.mode,
        "strategy": base.strategy.name,
        "model": base.model.name,
        "data": base.data.name,
        "steps": base.train.steps,
        "batch_size": base.train.batch_size,
        "batch_meaning": "per data-parallel rank" if args.mode == "weak" else "global",
        "cpu_cores": os.cpu_count(),
        "gpus": devices,
        "run_dir": str(root),
    }
    return out, info


def efficiency_rows(
    measured: list[dict[str, Any]], cores: int | None, gpus: int = 0, threads: int = 1
) -> list[dict[str, Any]]:
    """Add ``speedup`` and ``efficiency`` (against the smallest world size that ran) and ``oversubscribed``
    (CPU runs whose ranks x threads exceed the cores)."""
    ok = [r for r in measured if r.get("samples_per_s")]
    base = min(ok, key=lambda r: r["world_size"]) if ok else None
    rows = []
    for r in measured:
        row = dict(r)
        sps = r.get("samples_per_s")
        if base is not None and sps:
            speedup = sps / base["samples_per_s"]
            row["speedup"] = speedup
            row["efficiency"] = speedup / (r["world_size"] / base["world_size"])
        else:
            row["speedup"] = row["efficiency"] = None
        row["oversubscribed"] = not gpus and cores is not None and r["world_size"] * threads > cores
        rows.append(row)
    return rows


def format_table(result: dict[str, Any]) -> str:
    batch = f"batch {result['batch_size']} {result['batch_meaning']}"
    lines = [
        f"paratrain bench scaling: {result['mode']} scaling ({batch}), {result['model']} on {result['data']}, "
        f"{result['strategy']}, {result['steps']} steps; {result['cpu_cores']} CPU core(s), "
        f"{result['threads_per_rank']} thread(s) per rank"
        + (f", {result['gpus']} GPU(s)" if result["gpus"] else ""),
    ]
    cols = [Col("world", ">", 5), Col("global batch", ">", 12), Col("samples/s", ">", 10),
            Col("step (ms)", ">", 10), Col("speed-up", ">", 9), Col("efficiency", ">", 10)]  # fmt: skip
    rows, notes = [], []
    for r in result["rows"]:
        if r.get("samples_per_s") is None:
            rows.append([str(r["world_size"]), str(r["global_batch"])])
            notes.append(f"  failed: {r.get('error', 'no result')}")
            continue
        rows.append([str(r["world_size"]), str(r["global_batch"]), f"{r['samples_per_s']:.1f}",
                     f"{r['step_time_s'] * 1e3:.2f}", f"{r['speedup']:.2f}x", f"{r['efficiency']:.0%}"])  # fmt: skip
        notes.append(
            f"  oversubscribed: {r['world_size']} rank(s) on {result['cpu_cores']} core(s)"
            if r["oversubscribed"]
            else ""
        )
    head, *body = table(cols, rows)
    lines += [head] + [line + note for line, note in zip(body, notes, strict=True)]
    lines.append("speed-up = samples/s over the smallest world size's; efficiency = speed-up / (N / N0)")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> None:
    """samples/s against the world size (with the linear ideal), and the efficiency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("samples_per_s")]
    fig, (ax, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    if rows:
        ns = [r["world_size"] for r in rows]
        ax.plot(ns, [r["samples_per_s"] for r in rows], "o-", label="measured")
        n0, s0 = rows[0]["world_size"], rows[0]["samples_per_s"]
        ax.plot(ns, [s0 * n / n0 for n in ns], "--", color="0.5", label="linear")
        ax_eff.bar([str(n) for n in ns], [100 * r["efficiency"] for r in rows],
                   color=["tab:red" if r["oversubscribed"] else "tab:blue" for r in rows])  # fmt: skip
        ax.set_xticks(ns)
    ax.set(title=f"{result['mode']} scaling, {result['strategy']}, {result['model']}", xlabel="world size N",
           ylabel="samples/s")  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    ax_eff.axhline(100, color="0.5", linestyle="--")
    ax_eff.set(title="efficiency (red: more ranks than cores)", xlabel="world size N", ylabel="%")
    ax_eff.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """``paratrain bench scaling``: one training run per world size, then the table (or ``--json``)."""
    from paratrain.launch import LaunchError
    from paratrain.launch.train_job import run_training

    own = command_config(BenchScalingConfig, args)
    if own.plot is not None and not Path(own.plot).resolve().parent.is_dir():
        raise ConfigError(f"--plot {own.plot}: directory {Path(own.plot).parent} does not exist.")
    threads = own.threads_per_rank
    configs, info = build_configs(args)
    omp = os.environ.get("OMP_NUM_THREADS")
    info["threads_per_rank"] = omp if omp is not None else threads
    measured = []
    failed = False
    for n, cfg in configs:
        # One thread count for every world size, so that N ranks compare with 1 rank doing the same work
        # per core; "auto" lets the launcher give each rank cores // N threads.
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
            if threads != "auto":
                os.environ["OMP_NUM_THREADS"] = threads
        t0 = time.perf_counter()
        row: dict[str, Any] = {
            "world_size": n,
            "global_batch": cfg.train.batch_size,
            "run_dir": cfg.train.run_dir,
        }
        try:
            summary = run_training(cfg, quiet=True)
            sps = summary.get("samples_per_s")
            row.update(samples_per_s=sps, step_time_s=cfg.train.batch_size / sps if sps else None,
                       final_loss=summary.get("final_loss"), steps=summary.get("steps"))  # fmt: skip
            print(f"bench scaling: world size {n}: {sps or 0:.1f} samples/s ({time.perf_counter() - t0:.0f} s, "
                  f"{cfg.train.run_dir})", file=sys.stderr, flush=True)  # fmt: skip
        except LaunchError as e:
            failed = True
            row.update(samples_per_s=None, step_time_s=None, error=str(e).splitlines()[0])
            print(f"bench scaling: world size {n} failed: {e}", file=sys.stderr, flush=True)
        measured.append(row)
    if omp is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    per_rank = int(info["threads_per_rank"]) if str(info["threads_per_rank"]).isdigit() else 1
    result = {**info, "rows": efficiency_rows(measured, info["cpu_cores"], info["gpus"], per_rank)}
    if args.plot:
        plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print(format_table(result))
        if args.plot:
            print(f"wrote {args.plot}")
    return 1 if failed else 0
