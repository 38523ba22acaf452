"""What calling Gloo's backend directly saves per point-to-point message, against the process group.

paratrain's algorithms (``naive``, ``tree``, ``ring``, ``rhd``) send every message through
:class:`paratrain.comm._common.Peers`. On a Gloo group it calls the group's Gloo backend object
(``ProcessGroup._get_backend``), whose ``send``/``recv`` skip the operator dispatcher that
``ProcessGroup.send``/``recv`` go through. This benchmark measures the difference side by side, on the
same processes, the two ways taking turns in an order that rotates every repetition:

- ``pingpong``: ranks 0 and 1 bounce one message (4 B and 64 KiB); the time is half a round trip, and
  the CPU is the calling process's (every thread) per message sent and received;
- ``tree`` / ``ring``: paratrain's binomial-tree all-reduce at 4 B and ring all-reduce at 16 MB on all
  ranks, with the same ``Peers`` but for the way messages are sent (slowest rank's time per call).

Each figure is the median over ``--reps`` samples (a sample: ``--inner`` operations in a row after a
barrier, divided by ``--inner``), per run; ``--runs`` runs use separate process groups.

    python benchmarks/bench_p2p_dispatch.py --json       # 2 runs on 4 ranks, about a minute; writes
                                                         # benchmarks/results/p2p_dispatch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = ("group", "backend")


def _worker(reps: int, inner: int) -> dict[str, Any]:
    from paratrain.comm import ring, tree
    from paratrain.comm._common import peers

    torch.set_num_threads(1)
    via_backend = peers("bench", None)
    if via_backend.p2p is None:
        raise RuntimeError("this torch exposes no Gloo backend object: nothing to compare")
    ways = {"group": dataclasses.replace(via_backend, p2p=None), "backend": via_backend}
    rank, n = dist.get_rank(), dist.get_world_size()

    def pingpong(p: Any, t: torch.Tensor) -> None:
        if rank == 0:
            p.isend(t, 1).wait()
            p.irecv(t, 1).wait()
        elif rank == 1:
            p.irecv(t, 0).wait()
            p.isend(t, 0).wait()

    small, mid, big = torch.zeros(1), torch.zeros(16384), torch.zeros(4 << 20)
    cases = {
        "pingpong 4 B": lambda p: pingpong(p, small),
        "pingpong 64 KiB": lambda p: pingpong(p, mid),
        "tree all_reduce 4 B": lambda p: tree.all_reduce(small, "sum", p),
        "ring all_reduce 16 MB": lambda p: ring.all_reduce(big, "sum", p),
    }
    out: dict[str, Any] = {}
    for case, fn in cases.items():
        loops = max(1, inner // 50) if "16 MB" in case else inner
        wall: dict[str, list[float]] = {w: [] for w in WAYS}
        cpu: dict[str, list[float]] = {w: [] for w in WAYS}
        for rep in range(reps + 1):  # the first is warm-up
            for way in WAYS if rep % 2 == 0 else WAYS[::-1]:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(loops):
                    fn(ways[way])
                if rep:
                    wall[way].append((time.perf_counter() - t0) / loops)
                    cpu[way].append((time.process_time() - c0) / loops)
        w = torch.tensor([wall[k] for k in WAYS], dtype=torch.float64)
        c = torch.tensor([cpu[k] for k in WAYS], dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        dist.all_reduce(c)
        row = {}
        for i, way in enumerate(WAYS):
            t = statistics.median(w[i].tolist())
            if case.startswith("pingpong"):
                t /= 2  # one way
            row[way] = {"time_us": t * 1e6, "cpu_us_all_ranks": statistics.median(c[i].tolist()) * 1e6}
        row["group_over_backend"] = row["group"]["time_us"] / row["backend"]["time_us"]
        out[case] = row
    out["ranks"] = n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "p2p_dispatch.json")
    args = ap.parse_args()
    if args.ranks < 2 or min(args.runs, args.reps, args.inner) < 1:
        raise SystemExit("--ranks must be at least 2; --runs, --reps and --inner at least 1")
    runs = []
    for r in range(args.runs):
        load = os.getloadavg()[0]
        res = run_distributed(_worker, args.ranks, args=(args.reps, args.inner), timeout_s=900,
                              env={"OMP_NUM_THREADS": "1"})[0]  # fmt: skip
        runs.append({"load_avg_before": load, "results": res})
        for case, row in res.items():
            if case == "ranks":
                continue
            print(
                f"run {r + 1}, {case}: through the group {row['group']['time_us']:.1f} us "
                f"(CPU {row['group']['cpu_us_all_ranks']:.1f}), through the backend {row['backend']['time_us']:.1f} us "
                f"(CPU {row['backend']['cpu_us_all_ranks']:.1f}): group / backend {row['group_over_backend']:.3f}",
                file=sys.stderr,
            )
    doc = {"ranks": args.ranks, "cores": os.cpu_count(), "reps": args.reps, "inner": args.inner,
           "torch": torch.__version__, "runs": runs}  # fmt: skip
    if args.json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
