"""The shm direct all-reduce's block size: budgets for the peers' blocks, side by side, against Gloo.

The direct reduction reads the n−1 peers' blocks of a rank's chunk into a private buffer, reduces them into
the rank's own block and writes the result back into the peers (``comm/shm.py``). ``direct_block_bytes`` is
the peers' blocks together (each is 1/(n−1) of it). For each world size and size, every budget and Gloo's
all_reduce run once per iteration, interleaved in an order that rotates by one every iteration (the stored
``shm_block.json`` predates the rotation: fixed order, Gloo first), each call timed alone after a barrier
(the slowest rank's time, the median over iterations); ``--runs`` repeats the whole thing in fresh process
groups.

    python benchmarks/bench_shm_block.py --json      # under a minute here; benchmarks/results/shm_block.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.shm import ShmCommunicator
from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    comms = {b: ShmCommunicator(direct_block_bytes=b, direct_min_bytes=0) for b in spec["budgets"]}
    out: dict[str, Any] = {}
    for size in spec["sizes"]:
        x = torch.randn(size // 4)
        calls = {"gloo": lambda x=x: dist.all_reduce(x)}
        calls.update({str(b): (lambda c=c, x=x: c.all_reduce(x)) for b, c in comms.items()})
        times: dict[str, list[float]] = {k: [] for k in calls}
        iters = spec["iters"] if size < (32 << 20) else max(5, spec["iters"] // 2)
        names = list(calls)
        for it in range(2 + iters):
            for name in names[it % len(names) :] + names[: it % len(names)]:  # rotating order
                call = calls[name]
                dist.barrier()
                t = time.perf_counter()
                call()
                if it >= 2:
                    times[name].append(time.perf_counter() - t)
        table = torch.tensor([times[k] for k in calls], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        med = {k: statistics.median(table[i].tolist()) for i, k in enumerate(calls)}
        out[str(size)] = {k: {"time_s": v, "vs_gloo": med["gloo"] / v} for k, v in med.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--sizes-mb", default="4,16,64")
    p.add_argument("--budgets-kib", default="512,768,1024,1536")
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS / "shm_block.json")
    args = p.parse_args()
    spec = {
        "sizes": [int(s) << 20 for s in args.sizes_mb.split(",")],
        "budgets": [int(b) << 10 for b in args.budgets_kib.split(",")],
        "iters": args.iters,
    }
    result: dict[str, Any] = {
        "cores": os.cpu_count(),
        "spec": spec,
        "load_avg_before": os.getloadavg(),
        "runs": [],
    }
    for n in [int(r) for r in args.ranks.split(",")]:
        for run in range(args.runs):
            res = run_distributed(_worker, n, args=(spec,), timeout_s=1800, env={"OMP_NUM_THREADS": "1"})[0]
            result["runs"].append({"world_size": n, "run": run + 1, "sizes": res})
            for size, row in res.items():
                cells = ", ".join(f"{k} {v['vs_gloo']:.2f}x" for k, v in row.items() if k != "gloo")
                print(f"{n} ranks, run {run + 1}, {int(size) >> 20} MB: {cells}", file=sys.stderr, flush=True)
    result["load_avg_after"] = os.getloadavg()
    if args.json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
