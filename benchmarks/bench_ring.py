"""The ring all-reduce against Gloo at 16 and 64 MB on 4 ranks: pipelining depth, side by side, repeated.

At 16 MB on 4 ranks a chunk (S/n) is 4 MiB, exactly one ``PIECE_BYTES`` piece: before ``MIN_PIPELINED_BYTES``
the ring was not pipelined there (P = 1), each of its 2(n-1) = 6 steps waiting for a whole chunk; it now
cuts such a chunk in two. The calls below take turns in every iteration, in an order that rotates by
one each iteration (each after a barrier, timed alone; an iteration's time is the slowest rank's; a run's
figure is the median over ``--iters`` iterations), in ``--runs`` separate process groups. The results
stored before the rotation (``ring16_fixed_order.json``, ``ring16_b2b_fixed_order.json``,
``ring16_b2b_fixed_order_kept_scratch.json``, ``ring16_previous.json``) ran a fixed order, ``ring``
always right after ``native``:

- ``native``: Gloo's own ``all_reduce``;
- ``ring``: :func:`paratrain.comm.ring.all_reduce` as shipped (4 MiB pieces, at least 2 per chunk from
  1 MiB: P = 2 at 16 MB, 4 at 64 MB), over the ring's own TCP links (:mod:`paratrain.comm._tcp`) since
  2026-11-27 (stop 30); the runs stored before that measured it over c10d's point-to-point;
- ``ring-c10d``: the same ring over c10d's point-to-point (``ProcessGroup.send``/``recv`` of the Gloo
  backend), as shipped until stop 30;
- ``ring-1piece``: the ring before that rule (P = 1 at 16 MB: not pipelined);
- ``ring-2MiB`` / ``ring-1MiB``: the same with 2 / 1 MiB pieces (P = 2 / 4 at 16 MB, pipelined, a window
  of 4 / 8 receives);
- ``ring-no-reduction`` (timing only, its result is wrong): the shipped ring with the combination of a
  received piece into the local one replaced by nothing, to measure what the reductions cost; off unless
  ``--variants`` names it.

Also reported: CPU seconds per call summed over the ranks (``time.process_time``: every thread of a rank,
Gloo's included), steadier than wall time on a loaded machine, split into user and system time, and the
minor page faults per call (``getrusage``). With ``--back-to-back K`` each sample is
K calls in a row after one barrier (time and CPU per call), so the barrier's exit skew does not land on
every call.

    python benchmarks/bench_ring.py                  # 4 ranks, 16 and 64 MB, 3 runs (about 3-5 minutes)
    python benchmarks/bench_ring.py --json           # writes benchmarks/results/ring16.json
    python benchmarks/bench_ring.py --json --sizes 16 --runs 5 --iters 15 --back-to-back 5 \
        --out benchmarks/results/ring16_b2b.json       # 5 calls in a row per sample (nccl-tests' way)
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

from paratrain.launch.cpu_bind import allowed_cores, core_blocks
from paratrain.spec.cost import busbw
from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1 << 20


VARIANTS = (
    "native",
    "ring",
    "ring-c10d",
    "ring-1piece",
    "ring-2MiB",
    "ring-1MiB",
    "ring-no-reduction",
)
DEFAULT_VARIANTS = ("native", "ring", "ring-c10d", "ring-1piece", "ring-2MiB", "ring-1MiB")


def _no_reduction(x: torch.Tensor, p: Any) -> None:
    """The shipped ring with its reductions replaced by nothing (timing only: the result is wrong)."""
    from paratrain.comm import ring

    real = ring.combine_
    ring.combine_ = lambda dst, src, op: dst  # type: ignore[assignment]
    try:
        ring.all_reduce(x, "sum", p)
    finally:
        ring.combine_ = real


def _worker(
    sizes: list[int],
    iters: int,
    warmup: int,
    back_to_back: int = 1,
    bind: bool = False,
    variants: tuple[str, ...] = DEFAULT_VARIANTS,
) -> dict[str, Any]:
    import resource

    from paratrain.comm import ring
    from paratrain.comm._common import peers

    torch.set_num_threads(1)
    p, n = peers("bench", None), dist.get_world_size()
    if bind:  # as `paratrain launch --cpu-bind cores` places local rank r
        os.sched_setaffinity(0, core_blocks(allowed_cores(), n)[dist.get_rank()])
    out: dict[str, Any] = {}
    for size in sizes:
        x = torch.zeros(size // 4)

        calls = {
            "native": lambda x=x: dist.all_reduce(x),
            "ring": lambda x=x: ring.all_reduce(x, "sum", p),
            "ring-c10d": lambda x=x: ring.all_reduce(x, "sum", p, links=False),
            "ring-1piece": lambda x=x: ring.all_reduce(x, "sum", p, min_pipelined_bytes=1 << 40),
            "ring-2MiB": lambda x=x: ring.all_reduce(x, "sum", p, piece_bytes=2 * MB),
            "ring-1MiB": lambda x=x: ring.all_reduce(x, "sum", p, piece_bytes=1 * MB),
            "ring-no-reduction": lambda x=x: _no_reduction(x, p),
        }
        calls = {k: v for k, v in calls.items() if k in variants}
        wall: dict[str, list[float]] = {k: [] for k in calls}
        cpu: dict[str, list[float]] = {k: [] for k in calls}
        usage: dict[str, list[list[float]]] = {k: [] for k in calls}  # user s, system s, minor faults
        names = list(calls)
        for it in range(warmup + iters):
            # the order rotates every iteration, so that each variant runs in every position equally often
            for k in names[it % len(names) :] + names[: it % len(names)]:
                call = calls[k]
                dist.barrier()
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(back_to_back):  # > 1: the barrier's exit skew spread over the calls
                    call()
                if it >= warmup:
                    wall[k].append((time.perf_counter() - t0) / back_to_back)
                    cpu[k].append((time.process_time() - c0) / back_to_back)
                    r1 = resource.getrusage(resource.RUSAGE_SELF)
                    usage[k].append([
                        (r1.ru_utime - r0.ru_utime) / back_to_back, (r1.ru_stime - r0.ru_stime) / back_to_back,
                        (r1.ru_minflt - r0.ru_minflt) / back_to_back,
                    ])  # fmt: skip
        w = torch.tensor([wall[k] for k in calls], dtype=torch.float64)
        c = torch.tensor([cpu[k] for k in calls], dtype=torch.float64)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        dist.all_reduce(c)
        u = torch.tensor([usage[k] for k in calls], dtype=torch.float64)  # (variant, iteration, 3)
        dist.all_reduce(u)  # summed over the ranks
        mean_usage = u.mean(dim=1).tolist()
        med = {k: statistics.median(v) for k, v in zip(calls, w.tolist(), strict=True)}
        out[str(size)] = {
            k: {
                "time_s": med[k],
                "busbw_GBps": busbw("all_reduce", n, size, med[k]) / 1e9,
                "vs_native": med["native"] / med[k],
                "cpu_s_all_ranks": statistics.median(cv),
                "user_s_all_ranks_mean": mu[0],
                "sys_s_all_ranks_mean": mu[1],
                "minor_faults_all_ranks_mean": mu[2],
            }
            for k, cv, mu in zip(calls, c.tolist(), mean_usage, strict=True)
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--sizes", default="16,64", help="MB, comma-separated")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--back-to-back", type=int, default=1, metavar="K",
        help="time K calls in a row per sample after one barrier (time per call; default 1: each call alone)",
    )  # fmt: skip
    ap.add_argument(
        "--cpu-bind", choices=("none", "cores", "both"), default="none",
        help="pin the ranks as `paratrain launch --cpu-bind cores` does; both: each run unpinned, then pinned",
    )  # fmt: skip
    ap.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS),
        help=f"comma list of {', '.join(VARIANTS)} (native is always run)",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "ring16.json")
    args = ap.parse_args()
    variants = tuple(dict.fromkeys(["native", *[v for v in args.variants.split(",") if v]]))
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.back_to_back < 1 or args.runs < 1 or args.iters < 1:
        raise SystemExit("--back-to-back, --runs and --iters must be at least 1")
    sizes = [int(s) * MB for s in args.sizes.split(",")]
    runs = []
    binds = {"none": [False], "cores": [True], "both": [False, True]}[args.cpu_bind]
    for r, bind in ((r, b) for r in range(args.runs) for b in binds):
        load = os.getloadavg()[0]
        res = run_distributed(
            _worker, args.ranks, args=(sizes, args.iters, args.warmup, args.back_to_back, bind, variants),
            timeout_s=1800, env={"OMP_NUM_THREADS": "1"},
        )[0]  # fmt: skip
        runs.append({"load_avg_before": load, "load_avg": os.getloadavg()[0], "cpu_bind": bind, "sizes": res})
        for s, row in res.items():
            print(
                f"run {r + 1}{' pinned' if bind else ''}, {int(s) // MB} MB: "
                + ", ".join(
                    f"{k} {v['time_s'] * 1e3:.1f} ms ({v['vs_native']:.2f}x native, CPU "
                    f"{(v['user_s_all_ranks_mean'] + v['sys_s_all_ranks_mean']) * 1e3:.0f} ms, "
                    f"{v['minor_faults_all_ranks_mean']:.0f} faults)"
                    for k, v in row.items()
                ),
                file=sys.stderr,
                flush=True,
            )
    result = {
        "argv": sys.argv[1:], "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ranks": args.ranks, "cores": os.cpu_count(), "iters": args.iters, "back_to_back": args.back_to_back,
        "runs": runs,
    }  # fmt: skip
    if args.json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
