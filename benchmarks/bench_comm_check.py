"""What the cross-rank consistency check of ``paratrain.comm`` costs: a 16 MB ring all-reduce on 4 ranks with
the check on (the default) against ``check=False``, and Gloo's own all-reduce for scale.

The check compares every rank's call (collective, algorithm, op, root, dtype, shape) with one all-gather of
14 integers, once per call signature and group (``paratrain.comm._check.check_consistent``); the ring over
its own TCP links also sends its call layout ahead of its first piece. The variants take turns in every
iteration, in an order that rotates by one each iteration; each sample is ``--back-to-back`` calls after one
barrier, timed on every rank, the slowest rank's time per call kept; a run's figure is the median sample.

    python benchmarks/bench_comm_check.py --json     # writes benchmarks/results/comm_check.json (appends a run)
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

import torch
import torch.distributed as dist

from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("check", "check-every-call", "no-check", "native")
"""``check-every-call``: the check as it was before it remembered signatures (the cache emptied first)."""


def _worker(size_mb: int, iters: int, back_to_back: int) -> dict[str, list[float]]:
    from paratrain import comm
    from paratrain.comm._check import _VERIFIED

    def every_call() -> None:
        _VERIFIED.clear()
        comm.all_reduce(x, algorithm="ring")

    torch.set_num_threads(1)
    x = torch.rand(size_mb * (1 << 20) // 4)
    calls = {
        "check": lambda: comm.all_reduce(x, algorithm="ring"),
        "check-every-call": every_call,
        "no-check": lambda: comm.all_reduce(x, algorithm="ring", check=False),
        "native": lambda: dist.all_reduce(x),
    }
    for fn in calls.values():  # warm up: links, scratch, the one check of the signature
        fn()
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(iters):
        order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
        for v in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(back_to_back):
                calls[v]()
            dt = torch.tensor([(time.perf_counter() - t0) / back_to_back])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[v].append(dt.item())
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size-mb", type=int, default=16)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--back-to-back", type=int, default=3)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--json", action="store_true", help="append the run to benchmarks/results/comm_check.json"
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "comm_check.json")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    runs = []
    for _ in range(args.runs):
        per_rank = run_distributed(
            _worker, args.ranks, args=(args.size_mb, args.iters, args.back_to_back), timeout_s=600
        )
        med = {v: statistics.median(per_rank[0][v]) for v in VARIANTS}
        runs.append({
            "median_s": med,
            "check_over_no_check": med["check"] / med["no-check"],
            "check_every_call_over_no_check": med["check-every-call"] / med["no-check"],
        })  # fmt: skip
        print(
            f"{args.size_mb} MB, {args.ranks} ranks: ring with check {med['check'] * 1e3:.2f} ms, without "
            f"{med['no-check'] * 1e3:.2f} ms ({100 * (med['check'] / med['no-check'] - 1):+.1f}%; checking every "
            f"call {100 * (med['check-every-call'] / med['no-check'] - 1):+.1f}%), Gloo "
            f"{med['native'] * 1e3:.2f} ms"
        )
    record = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "conditions": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "ranks": args.ranks,
            "size_mb": args.size_mb,
            "iters": args.iters,
            "back_to_back": args.back_to_back,
            "loadavg_before": load_before,
            "note": "shared machine, loaded by other engineers' work during the run",
            "torch": torch.__version__,
        },
        "runs": runs,
    }
    if args.json:
        old = json.loads(args.out.read_text()) if args.out.exists() else []
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([*old, record], indent=1) + "\n")
        print(f"appended to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
