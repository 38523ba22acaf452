"""Data parallel, measured side by side in one run: paratrain ``ddp`` and ``dp`` against plain torch DDP.

In the same worker processes, on the same model (ResNet-18 for 32x32 inputs, width ``--width``), the same
in-memory data and the same per-rank batch, three training loops take turns (rotating order, ``--rounds``
blocks of ``--steps`` steps each, every block timed between barriers, median step time per loop, so machine noise hits all of them alike):

- **plain**: the hand-written loop of ``benchmarks/plain_ddp.py`` (torch DDP, nothing from paratrain);
- **ddp**: paratrain's ``Trainer.train_step`` with ``--strategy ddp`` (sampler, precision, scheduler...);
- **dp**: the same with ``--strategy dp`` and the native all-reduce (plus ``--algorithms`` if given);
- **plain/2**: a second copy of plain, as a control: how far it lands from 1.000x is this run's noise.

Reported: step time and its ratio to plain (median over rounds of the per-round ratio), and the CPU
time per step summed over ranks (steadier than wall time on a busy machine) (targets: ddp within 3%, dp within 1.15x); a scaling table for
1, 2, 4 ranks (samples/s with the per-rank batch fixed, speedup, efficiency = speedup / N); and the split
of a step into forward, backward, exposed communication and optimizer. Exposed communication = backward
time minus the same backward under ``no_sync`` (pure compute), for every strategy alike; for ``dp`` the
reducer's own measured wait is shown too.

    python benchmarks/bench_ddp.py              # tables (a few minutes on 2 cores)
    python benchmarks/bench_ddp.py --json       # one JSON object
    python benchmarks/bench_ddp.py --quick      # a smoke run

The raw result (the command, the machine's load average before and after, every figure) is written to
``--out`` (default ``benchmarks/results/ddp.json``; ``--out ''`` writes nothing).

On a CPU machine every rank is one process with one thread: N ranks on fewer than N cores compete for
cores, which the scaling table shows honestly rather than hides.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plain_ddp  # the baseline script next to this one

RESULTS = Path(__file__).resolve().parent / "results" / "ddp.json"


def _cfg(strategy: str, algorithm: str, args: argparse.Namespace, world: int, run_dir: str) -> Any:
    from paratrain.config import RunConfig

    return RunConfig().override([
        f"strategy.name={strategy}", f"strategy.comm_algorithm={algorithm}",
        "model.name=resnet18", f"model.channels={args.width}", "data.name=bench-images",
        f"data.num_samples={max(512, 4 * args.batch * world)}",
        f"train.batch_size={args.batch * world}", "train.steps=1000000", "train.epochs=none",
        "optimizer.name=sgd", "optimizer.lr=0.01", "train.progress=false", "checkpoint.save_at_end=false",
        "train.sync_batchnorm=false",  # plain DDP has local BatchNorm: the same model everywhere
        "train.log_every=1000000", f"train.run_dir={run_dir}",
    ])  # fmt: skip


def _register_dataset() -> None:
    from paratrain.data import Splits, TensorData, register_dataset

    @register_dataset("bench-images")
    def _images(cfg: Any) -> Splits:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(cfg.num_samples, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (cfg.num_samples,), generator=g)
        return Splits(TensorData(x, y), TensorData(x[:64], y[:64]), "classification", (3, 32, 32), 10)


def _plain_loop(args: argparse.Namespace, ctx: Any, run_dir: str) -> tuple[Callable[[], Any], Any]:
    """plain_ddp's model and step over the same data, indexed the way the sampler does (contiguous blocks)."""
    from paratrain.data import build_dataset
    from paratrain.models import build_model

    cfg = _cfg("ddp", "native", args, ctx.world_size, run_dir)
    data = build_dataset(cfg.data)
    model, opt = plain_ddp.build(build_model(cfg.model, (3, 32, 32), 10), ctx.device)
    n, b, w, r = len(data.train), args.batch, ctx.world_size, ctx.rank
    pos = [0]

    def step() -> Any:
        start = (pos[0] * b * w) % (n - b * w) + r * b
        pos[0] += 1
        x = data.train.x[start : start + b].to(ctx.device)
        y = data.train.y[start : start + b].to(ctx.device)
        return plain_ddp.step(model, opt, x, y)

    x, y = data.train.x[:b].to(ctx.device), data.train.y[:b].to(ctx.device)
    return step, (model, opt, None, x, y)


def _loops(
    args: argparse.Namespace, names: list[str], run_dir: str
) -> dict[str, tuple[Callable[[], Any], Any]]:
    """name -> (one training step, (model, optimizer, strategy or None, x, y) for the phase split)."""
    from paratrain.runtime import init
    from paratrain.train.worker import build_trainer

    out: dict[str, tuple[Callable[[], Any], Any]] = {}
    for name in names:
        strategy, _, algorithm = name.partition("/")
        ctx = init(seed=0)
        if strategy == "plain":  # "plain" and "plain/2"
            out[name] = _plain_loop(args, ctx, run_dir)
            continue
        cfg = _cfg(strategy, algorithm or "native", args, ctx.world_size, run_dir)
        trainer = build_trainer(cfg, ctx, Path(run_dir) / name.replace("/", "-"))
        x = trainer.data.train.x[: args.batch].to(ctx.device)
        y = trainer.data.train.y[: args.batch].to(ctx.device)
        out[name] = (trainer.train_step, (trainer.model, trainer.optimizer, trainer.strategy, x, y))
    return out


def _timed(fn: Callable[[], Any], steps: int, sync: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) per step. CPU time excludes the time the
    process waited for a core, so on a shared machine it shows the *work* a loop does far more steadily."""
    import torch.distributed as dist

    dist.barrier()
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps


def _phase_step(objs: Any, communicate: bool, sync: Callable[[], None], rows: dict[str, list[float]]) -> None:
    """One step timed phase by phase; ``communicate=False`` runs backward under ``no_sync`` (pure compute)."""
    import torch.distributed as dist

    model, opt, strategy, x, y = objs
    no_sync = strategy.no_sync if strategy is not None else (lambda m: m.no_sync())
    reducer = getattr(strategy, "reducer", None)
    dist.barrier()
    wait0 = reducer.wait_s if reducer is not None else 0.0
    opt.zero_grad(set_to_none=True)
    sync()
    t0 = time.perf_counter()
    with contextlib.nullcontext() if communicate else no_sync(model):
        loss = nn.functional.cross_entropy(model(x), y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
    if not communicate:
        rows["backward_compute"].append(t2 - t1)
        return
    opt.step()  # replicas stay identical: the optimizer only steps on synchronised gradients
    sync()
    rows["optimizer"].append(time.perf_counter() - t2)
    rows["backward"].append(t2 - t1)
    rows["forward"].append(t1 - t0)
    if reducer is not None:
        rows["dp_wait"].append(reducer.wait_s - wait0)


def _phase_split(loops: dict[str, Any], steps: int, sync: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Median seconds of forward, backward, exposed communication and optimizer per loop. The loops take
    turns step by step (as in the step-time measurement), so load drift hits them alike."""
    names = list(loops)
    rows = {
        n: {k: [] for k in ("forward", "backward", "backward_compute", "optimizer", "dp_wait")} for n in names
    }
    for i in range(2 * steps):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            # a synchronised step, then the same step under no_sync: one pair per exposed-comm sample
            _phase_step(loops[n][1], i % 2 == 0, sync, rows[n])
    out = {}
    for n in names:
        med = {k: statistics.median(v) for k, v in rows[n].items() if v}
        diffs = [a - b for a, b in zip(rows[n]["backward"], rows[n]["backward_compute"], strict=True)]
        med["exposed_comm"] = max(0.0, statistics.median(diffs))
        out[n] = med
    return out


def _bench_rank(args: argparse.Namespace, names: list[str], with_split: bool, run_dir: str) -> dict[str, Any]:
    import torch.distributed as dist

    from paratrain.runtime import device_synchronizer, init

    torch.set_num_threads(1)
    _register_dataset()
    ctx = init(seed=0)
    sync = device_synchronizer(ctx.device)
    loops = _loops(args, names, run_dir)  # the driver's temporary directory: the ranks share their run dir
    for fn, _ in loops.values():  # warm-up: allocator, DDP bucket rebuild, first-touch
        for _ in range(args.warmup):
            fn()
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            wall, c = _timed(loops[n][0], args.steps, sync)
            times[n].append(wall)
            cpu[n].append(c)
    split = _phase_split(loops, args.split_steps, sync) if with_split else {}
    # Per-block times, max over ranks (a step is as slow as its slowest rank), then per-loop medians and the
    # median of *paired* ratios: blocks of one round ran back to back, so drifting machine load cancels.
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    med = t.median(dim=1).values.tolist()
    paired = (t / t[0]).median(dim=1).values.tolist()
    c = torch.tensor([cpu[n] for n in names], dtype=torch.float64)
    dist.all_reduce(c)  # CPU seconds per step summed over ranks
    cpu_med = c.median(dim=1).values
    return {
        "step_s": dict(zip(names, med, strict=True)),
        "paired_ratio": dict(zip(names, paired, strict=True)),
        "cpu_s": dict(zip(names, cpu_med.tolist(), strict=True)),
        "cpu_ratio": dict(zip(names, (cpu_med / cpu_med[0]).tolist(), strict=True)),
        "split": split,
        "world_size": ctx.world_size,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=16, help="ResNet-18 first-stage width (64 = the paper's)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    p.add_argument("--steps", type=int, default=1, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=30, help="timed blocks per loop (rotating order)")
    p.add_argument("--split-steps", type=int, default=20, help="steps of each phase-split measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--world-size", type=int, default=2, help="ranks of the side-by-side comparison")
    p.add_argument("--scaling", default="1,2,4", help="rank counts of the scaling table ('' to skip)")
    p.add_argument("--algorithms", default="", help="extra dp all-reduces to time, e.g. ring,tree")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=str(RESULTS), help="where to store the raw JSON ('' for nowhere)")
    args = p.parse_args(argv)
    t_start, load_start = time.perf_counter(), os.getloadavg()
    if args.quick:
        args.width, args.batch, args.rounds, args.split_steps, args.warmup, args.scaling = (
            8,
            8,
            4,
            2,
            1,
            "1,2",
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from paratrain.testing import run_distributed

    # "plain/2" is a second, identical plain loop: its ratio to "plain" is the noise floor of this run.
    names = ["plain", "plain/2", "ddp", "dp"] + [f"dp/{a}" for a in args.algorithms.split(",") if a]
    # One run directory per process group, made here: every rank of a group gets the same path (a directory
    # per rank fails the trainer's check that the ranks share their checkpoint directory).
    holder = tempfile.TemporaryDirectory(prefix="bench-ddp-")
    side = run_distributed(
        _bench_rank, args.world_size, args=(args, names, True, f"{holder.name}/side"), timeout_s=1800
    )[0]
    plain = side["step_s"]["plain"]
    result: dict[str, Any] = {
        "command": "python benchmarks/bench_ddp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],  # other work on the machine distorts every number here
        "side_by_side": {
            n: {
                "step_ms": 1e3 * t,
                "ratio_of_medians": t / plain,
                "ratio_to_plain": side["paired_ratio"][n],
                "cpu_ms": 1e3 * side["cpu_s"][n],
                "cpu_ratio": side["cpu_ratio"][n],
            }
            for n, t in side["step_s"].items()
        },
        "split_ms": {n: {k: 1e3 * v for k, v in s.items()} for n, s in side["split"].items()},
        "scaling": [],
    }
    base = None
    for n in [int(s) for s in args.scaling.split(",") if s]:
        r = run_distributed(
            _bench_rank, n, args=(args, ["ddp", "dp"], False, f"{holder.name}/scaling-{n}"), timeout_s=1800
        )[0]
        row: dict[str, Any] = {"ranks": n}
        for name, t in r["step_s"].items():
            sps = n * args.batch / t
            if base is None or name not in base:
                base = {**(base or {}), name: sps} if n == 1 else base
            b1 = (base or {}).get(name)
            row[name] = {"samples_per_s": sps, "speedup": sps / b1 if b1 else None,
                         "efficiency": sps / b1 / n if b1 else None}  # fmt: skip
        result["scaling"].append(row)
    holder.cleanup()
    result["load_average_before"] = load_start
    result["load_average_after"] = os.getloadavg()
    result["elapsed_s"] = time.perf_counter() - t_start
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


def _print(r: dict[str, Any]) -> None:
    c = r["config"]
    print(f"ResNet-18 (width {c['width']}), per-rank batch {c['batch']}, {c['world_size']} ranks, {r['device']} "
          f"({r['cpus']} cores, load {r['load_average_1m']:.1f}); median of {c['rounds']} blocks x {c['steps']} steps\n")  # fmt: skip
    print(
        f"{'loop':<10} {'ms/step':>9} {'vs plain':>9} {'(ratio of medians)':>19} {'CPU ms/step':>12} {'CPU vs plain':>13}"
    )
    for n, v in r["side_by_side"].items():
        print(f"{n:<10} {v['step_ms']:>9.1f} {v['ratio_to_plain']:>8.3f}x {v['ratio_of_medians']:>18.3f}x "
              f"{v['cpu_ms']:>12.1f} {v['cpu_ratio']:>12.3f}x")  # fmt: skip
    print(
        f"\n{'loop':<10} {'forward':>8} {'backward':>9} {'exposed comm':>13} {'optimizer':>10}  (ms; dp wait)"
    )
    for n, s in r["split_ms"].items():
        wait = f"  {s['dp_wait']:.1f}" if "dp_wait" in s else ""
        print(f"{n:<10} {s['forward']:>8.1f} {s['backward_compute']:>9.1f} {s['exposed_comm']:>13.1f} "
              f"{s['optimizer']:>10.1f}{wait}")  # fmt: skip
    if r["scaling"]:
        print(f"\n{'ranks':>5} {'strategy':<8} {'samples/s':>10} {'speedup':>8} {'efficiency':>10}")
        for row in r["scaling"]:
            for name in ("ddp", "dp"):
                v = row[name]
                sp = f"{v['speedup']:.2f}" if v["speedup"] else "-"
                ef = f"{v['efficiency']:.0%}" if v["efficiency"] else "-"
                print(f"{row['ranks']:>5} {name:<8} {v['samples_per_s']:>10.1f} {sp:>8} {ef:>10}")


if __name__ == "__main__":
    raise SystemExit(main())
