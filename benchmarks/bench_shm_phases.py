"""Where the time of shm's direct all-reduce goes, rank by rank: the ARRIVE wait, this rank's chunk, DONE.

``ShmCommunicator.trace`` records, for each direct all-reduce, the wall clock at entry, past the ARRIVE
barrier, after the rank's own chunk (read the peers' blocks, reduce, write the results back) and past the
DONE barrier, and the thread's CPU seconds in the wait and in the chunk. For each world size and size,
the shm all-reduce and Gloo's run once per iteration in turn (the order alternating), each call alone after
a barrier. Per size it reports:

- ``wall_ms``: the call, from the first rank's entry to the last rank's return (median over iterations),
  and Gloo's time (``gloo_ms``: the slowest rank's time from its own entry, as ``bench_shm.py`` times
  every algorithm), with their ratio (conservative for shm: its span starts at the first entry);
- ``chunk_cpu_ms``: CPU time of one rank's chunk (median over ranks and iterations); ``chunk_GBps``: the
  bytes its chunk moves (2(n-1)/n·S: read in and written out) per CPU second, against the one-core
  ``copy_`` speed measured in the same run;
- ``busy_cores``: the chunks' CPU seconds of all ranks over the call's wall time (at most the number of
  cores): how much of the machine the reduction itself keeps busy;
- ``arrive_wait_ms``: from a rank's entry to passing ARRIVE (the skew of the barrier before the call).

    python benchmarks/bench_shm_phases.py --json      # about a minute here (3 runs); results/shm_phases.json
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

from paratrain.bench.comm import parse_sizes
from paratrain.comm.shm import ShmCommunicator
from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"


def _copy_gbps(nbytes: int = 64 << 20, reps: int = 7) -> float:
    """One core's ``copy_`` speed (bytes copied per second), as the ranks run with one thread each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _copy_once(nbytes, reps)
    finally:
        torch.set_num_threads(threads)


def _copy_once(nbytes: int, reps: int) -> float:
    a, b = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    c = ShmCommunicator(direct_min_bytes=0)  # every size takes the direct path
    if not c.direct:
        raise RuntimeError("the direct path is not available here (process_vm_readv refused)")
    out: dict[str, Any] = {}
    for size in spec["sizes"]:
        x = torch.zeros(size // 4)
        c.trace = []
        gloo: list[float] = []
        for it in range(spec["warmup"] + spec["iters"]):
            for name in ("shm", "gloo") if it % 2 == 0 else ("gloo", "shm"):
                dist.barrier()
                if name == "shm":
                    c.all_reduce(x)
                else:
                    t = time.perf_counter()
                    dist.all_reduce(x)
                    gloo.append(time.perf_counter() - t)
        rows = torch.tensor(c.trace[spec["warmup"] :], dtype=torch.float64)
        every = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(every, rows)
        g = torch.tensor(gloo[spec["warmup"] :], dtype=torch.float64)
        dist.all_reduce(g, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
        out[str(size)] = {"trace": torch.stack(every).tolist(), "gloo_s": g.tolist()}
    c.close()
    return out


def summarize(n: int, size: int, raw: dict[str, Any], copy_gbps: float, cores: int) -> dict[str, Any]:
    tr = torch.tensor(raw["trace"], dtype=torch.float64)  # ranks × iterations × 6
    entry, arrived, worked, done, _wait_cpu, chunk_cpu = tr.unbind(-1)
    wall = done.max(0).values - entry.min(0).values  # per iteration
    gloo = statistics.median(raw["gloo_s"])
    moved = 2 * (n - 1) / n * size  # one rank's chunk: (n-1)/n·S read in, the same written out
    cpu = statistics.median(chunk_cpu.flatten().tolist())
    return {
        "world_size": n,
        "bytes": size,
        "iters": tr.shape[1],
        "wall_ms": statistics.median(wall.tolist()) * 1e3,
        "gloo_ms": gloo * 1e3,
        "gloo_over_shm": gloo / statistics.median(wall.tolist()),
        "chunk_wall_ms": statistics.median((worked - arrived).flatten().tolist()) * 1e3,
        "chunk_cpu_ms": cpu * 1e3,
        "chunk_GBps": moved / cpu / 1e9,
        "chunk_vs_copy": moved / cpu / 1e9 / copy_gbps,
        "busy_cores": statistics.median((chunk_cpu.sum(0) / wall).tolist()),
        "cores": cores,
        "arrive_wait_ms": statistics.median((arrived - entry).flatten().tolist()) * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4", help="world sizes (default 2,4)")
    p.add_argument("--sizes", default="4MB,16MB,64MB", help="all-reduce sizes S (default 4MB,16MB,64MB)")
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=3, help="repeat everything in fresh process groups")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--out", type=Path, default=RESULTS / "shm_phases.json", help="where to store the JSON")
    args = p.parse_args()
    sizes = parse_sizes(args.sizes)
    ranks = [int(v) for v in args.ranks.split(",")]
    cores = os.cpu_count() or 1
    copy_gbps = _copy_gbps()
    load_before = list(os.getloadavg())
    rows = []
    for run in range(args.runs):
        for n in ranks:
            print(f"run {run + 1}/{args.runs}: {n} ranks ...", file=sys.stderr, flush=True)
            spec = {"sizes": sizes, "iters": args.iters, "warmup": args.warmup}
            raw = run_distributed(_worker, n, args=(spec,), env={"OMP_NUM_THREADS": "1"}, timeout_s=600)[0]
            rows += [dict(summarize(n, s, raw[str(s)], copy_gbps, cores), run=run) for s in sizes]
    result = {
        "machine": {"cores": cores, "torch": torch.__version__},
        "copy_GBps_one_core": copy_gbps,
        "load_avg_before": load_before,
        "load_avg_after": list(os.getloadavg()),
        "spec": {
            "ranks": ranks,
            "sizes": sizes,
            "iters": args.iters,
            "warmup": args.warmup,
            "runs": args.runs,
        },
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return
    print(f"one-core copy_: {copy_gbps:.2f} GB/s; {cores} cores")
    print(
        "ranks  size  wall ms  Gloo ms  Gloo/shm  chunk ms (CPU)  chunk GB/s  vs copy  busy cores  arrive ms"
    )
    for r in rows:
        print(
            f"{r['run']:>3} {r['world_size']:>5} {r['bytes'] >> 20:>4}MB {r['wall_ms']:8.2f} {r['gloo_ms']:8.2f} "
            f"{r['gloo_over_shm']:8.2f}x {r['chunk_wall_ms']:7.2f} ({r['chunk_cpu_ms']:.2f}) "
            f"{r['chunk_GBps']:10.2f} {r['chunk_vs_copy']:8.2f} {r['busy_cores']:10.2f} {r['arrive_wait_ms']:9.2f}"
        )


if __name__ == "__main__":
    main()
