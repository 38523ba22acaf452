"""What the cross-rank consistency check of ``paratrain.comm`` costs: a 16 MB ring all-reduce on 4 ranks with
the check on (the default) against ``check=False``, side by side in one run.

The check compares every rank's call (collective, algorithm, op, root, dtype, shape) with one all-gather of
14 integers, once per call signature and group (``paratrain.comm._check.check_consistent``); after that a
checked call computes its signature and finds it in a set. Three variants take turns in every round, in an
order that rotates each round: ``check`` (the default), ``no-check`` (``check=False``) and
``check-every-call`` (the signature cache emptied before each call: the all-gather on every call). A sample is
``--back-to-back`` calls after one barrier. Two measures per sample:

- wall: the slowest rank's seconds per call (noisy on a loaded machine);
- CPU: the CPU seconds per call (``time.process_time``: every thread of the process) summed over the ranks,
  less sensitive to the other processes of the machine (time spent waiting for a descheduled peer is not
  CPU time).

A round's figure is the paired ratio check / no-check of its own samples; the run stores every round's
ratios and their median, and the summed CPU ratio over all rounds. Also stored: the time of the check
itself on a signature already checked (``check_consistent`` alone, averaged over many calls), the part of a
checked call that the unchecked call does not run.

    python benchmarks/bench_comm_check.py --json     # appends a run to benchmarks/results/comm_check.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("check", "no-check", "check-every-call")


def _worker(size_mb: int, rounds: int, back_to_back: int) -> dict[str, Any]:
    from paratrain import comm
    from paratrain.comm._check import _VERIFIED, check_consistent
    from paratrain.comm._common import peers as group_peers

    def every_call() -> None:
        _VERIFIED.clear()
        comm.all_reduce(x, algorithm="ring")

    torch.set_num_threads(1)
    x = torch.rand(size_mb * (1 << 20) // 4)
    calls = {
        "check": lambda: comm.all_reduce(x, algorithm="ring"),
        "no-check": lambda: comm.all_reduce(x, algorithm="ring", check=False),
        "check-every-call": every_call,
    }
    for fn in calls.values():  # warm up: links, scratch, the one check of the signature
        fn()
    calls["check"]()
    wall: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(rounds):
        order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
        for v in order:
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(back_to_back):
                calls[v]()
            dt = torch.tensor(
                [(time.perf_counter() - t0) / back_to_back, (time.process_time() - c0) / back_to_back]
            )
            wall_t, cpu_t = dt.clone(), dt.clone()
            dist.all_reduce(wall_t, op=dist.ReduceOp.MAX)
            dist.all_reduce(cpu_t, op=dist.ReduceOp.SUM)
            wall[v].append(wall_t[0].item())
            cpu[v].append(cpu_t[1].item())
    # the check alone on a signature already checked: what a checked call runs that an unchecked one does not
    peers = group_peers("all_reduce", None)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        check_consistent(peers, "all_reduce", "ring", "sum", -1, x)
    check_alone = torch.tensor([(time.perf_counter() - t0) / n])
    dist.all_reduce(check_alone, op=dist.ReduceOp.MAX)
    return {"wall_s": wall, "cpu_s": cpu, "check_alone_s": check_alone.item()}


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    wall, cpu = r["wall_s"], r["cpu_s"]
    ratios = [a / b for a, b in zip(wall["check"], wall["no-check"], strict=True)]
    every = [a / b for a, b in zip(wall["check-every-call"], wall["no-check"], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu["check"], cpu["no-check"], strict=True)]
    return {
        "wall_ratio_per_round": ratios,
        "wall_ratio_median": statistics.median(ratios),
        "every_call_wall_ratio_median": statistics.median(every),
        "cpu_ratio_per_round": cpu_ratios,
        "cpu_ratio_median": statistics.median(cpu_ratios),
        "cpu_ratio_total": sum(cpu["check"]) / sum(cpu["no-check"]),
        "every_call_cpu_ratio_total": sum(cpu["check-every-call"]) / sum(cpu["no-check"]),
        "median_wall_s": {v: statistics.median(wall[v]) for v in VARIANTS},
        "check_alone_s": r["check_alone_s"],
        "check_alone_over_no_check_wall": r["check_alone_s"] / statistics.median(wall["no-check"]),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mb", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--back-to-back", type=int, default=2)
    ap.add_argument(
        "--json", action="store_true", help="append the run to benchmarks/results/comm_check.json"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "comm_check.json")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    t0 = time.time()
    per_rank = run_distributed(
        _worker, args.ranks, args=(args.size_mb, args.rounds, args.back_to_back), timeout_s=1800
    )
    s = _summary(per_rank[0])
    lo, hi = min(s["wall_ratio_per_round"]), max(s["wall_ratio_per_round"])
    print(
        f"{args.size_mb} MB ring all-reduce, {args.ranks} ranks, {args.rounds} rounds: check / no-check wall "
        f"median {s['wall_ratio_median']:.3f} (rounds {lo:.2f}-{hi:.2f}), CPU summed over ranks "
        f"{s['cpu_ratio_total']:.3f} (median round {s['cpu_ratio_median']:.3f}); checking every call: wall "
        f"{s['every_call_wall_ratio_median']:.3f}, CPU {s['every_call_cpu_ratio_total']:.3f}; the check alone "
        f"{s['check_alone_s'] * 1e6:.1f} us ({100 * s['check_alone_over_no_check_wall']:.4f}% of a call)"
    )
    record = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "method": "paired rounds",
        "conditions": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "ranks": args.ranks,
            "size_mb": args.size_mb,
            "rounds": args.rounds,
            "back_to_back": args.back_to_back,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "duration_s": time.time() - t0,
            "note": "shared 2-core machine, loaded by other engineers' work during the run",
            "torch": torch.__version__,
        },
        **s,
    }
    if args.json:
        old = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([*old, record], indent=1) + "\n")
        print(f"appended to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
