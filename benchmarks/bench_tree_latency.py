"""Small-message latency of the star and the binomial tree: does the tree's log2(n) pay off here?

Issue 3 asks for the tree to beat ``naive`` by 1.5x on 4 ranks and small messages. The 1.5 is the α-β
model's ratio for a star whose root handles its n-1 messages one after the other (2(n-1)α = 6α for
all_reduce against the tree's 2·log2(n)·α = 4α). This benchmark measures that premise side by side, in
one run, on the same processes:

- ``naive``: paratrain's star (the root posts all of its isend/irecv at once);
- ``seed-star``: seed 003's star, written here with blocking ``dist.send``/``dist.recv``, one peer at a
  time, exactly the schedule the 6α figure assumes;
- ``tree``: paratrain's binomial tree;
- ``native``: Gloo's own collective.

Two timing modes, both reporting the median over repetitions:

- ``synced``: a barrier, then one operation; the time is the slowest rank's (what a training step sees);
- ``back-to-back``: ``--inner`` operations in a row between two barriers, divided by ``--inner`` (the
  nccl-tests way, where a busy root becomes a throughput bottleneck).

It also measures the two quantities the model is made of: the one-way latency of a message (half a
ping-pong between ranks 0 and 1, i.e. what one dependent hop costs) and the CPU time the root's
calling thread spends per message it handles.

    python benchmarks/bench_tree_latency.py                  # about 5 minutes on the 2-core VM
    python benchmarks/bench_tree_latency.py --quick --json   # smoke run, one JSON object

Prints markdown tables (quoted in BENCHMARKS.md), writes ``results/tree_latency.json`` and
``results/tree_latency.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

RESULTS = Path(__file__).resolve().parent / "results"
ALGORITHMS = ("naive", "seed-star", "tree", "native")
COLLECTIVES = ("broadcast", "reduce", "all_reduce")


# seed 003's star: blocking send/recv, the root serves one peer after the other ------------------------


def seed_broadcast(x: torch.Tensor, src: int = 0) -> None:
    if dist.get_rank() == src:
        for peer in range(dist.get_world_size()):
            if peer != src:
                dist.send(x, dst=peer)
    else:
        dist.recv(x, src=src)


def seed_reduce(x: torch.Tensor, dst: int = 0) -> None:
    if dist.get_rank() != dst:
        dist.send(x, dst=dst)
        return
    incoming = torch.empty_like(x)
    for peer in range(dist.get_world_size()):
        if peer != dst:
            dist.recv(incoming, src=peer)
            x += incoming


def seed_all_reduce(x: torch.Tensor) -> None:
    seed_reduce(x, 0)
    seed_broadcast(x, 0)


# the worker --------------------------------------------------------------------------------------


def _operation(collective: str, algorithm: str, x: torch.Tensor) -> Callable[[], Any]:
    from paratrain import comm

    if algorithm == "seed-star":
        seed = {"broadcast": seed_broadcast, "reduce": seed_reduce, "all_reduce": seed_all_reduce}
        fn = seed[collective]
        return lambda: fn(x)
    if collective == "broadcast":
        return lambda: comm.broadcast(x, 0, algorithm, check=False)
    if collective == "reduce":
        return lambda: comm.reduce(x, 0, "sum", algorithm, check=False)
    return lambda: comm.all_reduce(x, "sum", algorithm, check=False)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def check_results(rank: int, n: int) -> None:
    """Every algorithm must compute the right thing before it is timed (rank r contributes r + 1)."""
    total = n * (n + 1) // 2
    for c in COLLECTIVES:
        for a in ALGORITHMS:
            x = torch.full((37,), float(rank + 1))
            _operation(c, a, x)()
            want = {"broadcast": 1.0, "reduce": float(total) if rank == 0 else float(rank + 1)}.get(
                c, float(total)
            )
            if c == "reduce" and rank != 0 and a == "native":
                continue  # Gloo may leave partial sums on the other ranks; only dst is defined
            if not torch.equal(x, torch.full((37,), want)):
                raise AssertionError(f"{c}/{a} on rank {rank}: expected {want}, got {x[:3].tolist()}...")


def worker(sizes: list[int], reps: int, inner: int, warmup: int) -> dict[str, Any]:
    """Runs on every rank; rank 0's return value is the result."""
    rank, n = dist.get_rank(), dist.get_world_size()
    check_results(rank, n)
    rows: list[dict[str, Any]] = []
    for nbytes in sizes:
        x = torch.zeros(max(1, nbytes // 4))  # zeros: repeated sums stay finite
        ops = {(c, a): _operation(c, a, x) for c in COLLECTIVES for a in ALGORITHMS}
        synced: dict[tuple[str, str], list[float]] = {k: [] for k in ops}
        burst: dict[tuple[str, str], list[float]] = {k: [] for k in ops}
        root_cpu: dict[tuple[str, str], list[float]] = {k: [] for k in ops}
        for it in range(warmup + reps):
            for key, op in ops.items():  # interleaved: every algorithm sees the same machine state
                dist.barrier()
                c0, t0 = time.thread_time(), time.perf_counter()
                op()
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                slowest = _slowest(dt)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    op()
                dist.barrier()
                per_op = _slowest((time.perf_counter() - t0) / inner)
                if it >= warmup:
                    synced[key].append(slowest)
                    burst[key].append(per_op)
                    root_cpu[key].append(dc)
        for key in ops:
            rows.append({
                "collective": key[0], "algorithm": key[1], "bytes": nbytes,
                "synced_s": statistics.median(synced[key]),
                "back_to_back_s": statistics.median(burst[key]),
                "root_thread_cpu_s": statistics.median(root_cpu[key]),
            })  # fmt: skip
    # one dependent hop: half a ping-pong between ranks 0 and 1 (the others wait in the barrier)
    x = torch.ones(256)
    hops = []
    for _ in range(warmup + 4 * reps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(x, 1)
            dist.recv(x, 1)
        elif rank == 1:
            dist.recv(x, 0)
            dist.send(x, 0)
        hops.append((time.perf_counter() - t0) / 2)
    return {"world_size": n, "hop_s": statistics.median(hops[warmup:]) if rank == 0 else None, "rows": rows}


# the driver -----------------------------------------------------------------------------------------


def run(world_size: int, sizes: list[int], reps: int, inner: int, warmup: int) -> dict[str, Any]:
    from paratrain.testing import run_distributed

    results = run_distributed(
        worker, world_size, args=(sizes, reps, inner, warmup), timeout_s=1200.0,
        env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return dict(results[0])


def table(result: dict[str, Any], mode: str) -> str:
    """Markdown: one row per (collective, size), ms per algorithm, then naive/tree and seed-star/tree."""
    key = "synced_s" if mode == "synced" else "back_to_back_s"
    by = {(r["collective"], r["bytes"], r["algorithm"]): r[key] for r in result["rows"]}
    sizes = sorted({r["bytes"] for r in result["rows"]})
    head = "| collective | S | " + " | ".join(ALGORITHMS) + " | naive / tree | seed-star / tree |"
    lines = [head, "|" + "---|" * (len(ALGORITHMS) + 4)]
    for c in COLLECTIVES:
        for s in sizes:
            ms = [by[(c, s, a)] * 1e3 for a in ALGORITHMS]
            tree = by[(c, s, "tree")]
            lines.append(
                f"| {c} | {s // 1024}KB | " + " | ".join(f"{v:.2f}" for v in ms)
                + f" | {by[(c, s, 'naive')] / tree:.2f}x | {by[(c, s, 'seed-star')] / tree:.2f}x |"
            )  # fmt: skip
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """all_reduce time per algorithm (bars) for each world size and mode, at the smallest size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = min(r["bytes"] for r in results[0]["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, (mode, key) in zip(
        axes[0], (("synced", "synced_s"), ("back-to-back", "back_to_back_s")), strict=True
    ):
        width = 0.8 / len(ALGORITHMS)
        for i, alg in enumerate(ALGORITHMS):
            ys = []
            for res in results:
                row = next(r for r in res["rows"] if (r["collective"], r["bytes"], r["algorithm"]) ==
                           ("all_reduce", size, alg))  # fmt: skip
                ys.append(row[key] * 1e3)
            xs = [j + (i - (len(ALGORITHMS) - 1) / 2) * width for j in range(len(results))]
            ax.bar(xs, ys, width, label=alg)
        ax.set_xticks(range(len(results)), [f"{r['world_size']} ranks" for r in results])
        ax.set_ylabel("ms per all_reduce (lower is better)")
        ax.set_title(f"all_reduce of {size // 1024} KB, {mode}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="4,8", help="comma list (default 4,8)")
    parser.add_argument("--sizes", default="1024,16384", help="message sizes in bytes (default 1 KB, 16 KB)")
    parser.add_argument("--reps", type=int, default=60, help="repetitions per algorithm (default 60)")
    parser.add_argument(
        "--inner", type=int, default=20, help="operations per back-to-back burst (default 20)"
    )
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 ranks, 1 KB, few repetitions")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON and the PNG go")
    args = parser.parse_args()
    world_sizes = [int(w) for w in args.world_sizes.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        world_sizes, sizes, args.reps, args.inner, args.warmup = [4], [1024], 5, 3, 1
    if min(world_sizes) < 2 or min(sizes) < 4:
        parser.error("--world-sizes need at least 2 ranks and --sizes at least 4 bytes")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t_start = time.perf_counter()
    results = []
    for n in world_sizes:
        print(f"[bench_tree_latency] {n} ranks ...", file=sys.stderr, flush=True)
        results.append(run(n, sizes, args.reps, args.inner, args.warmup))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"command": " ".join(["python benchmarks/bench_tree_latency.py", *sys.argv[1:]]),
               "load_avg_1min": os.getloadavg()[0], "cpus": os.cpu_count(), "reps": args.reps,
               "inner": args.inner, "elapsed_s": time.perf_counter() - t_start, "results": results}  # fmt: skip
    (args.out / "tree_latency.json").write_text(json.dumps(payload, indent=1))
    plot(results, args.out / "tree_latency.png")
    if args.json:
        print(json.dumps(payload))
        return
    for res in results:
        cpu = {r["algorithm"]: r["root_thread_cpu_s"] for r in res["rows"]
               if r["collective"] == "all_reduce" and r["bytes"] == min(sizes)}  # fmt: skip
        print(f"## {res['world_size']} ranks (one hop: {res['hop_s'] * 1e3:.3f} ms; root thread CPU per "
              f"all_reduce: naive {cpu['naive'] * 1e3:.3f} ms, tree {cpu['tree'] * 1e3:.3f} ms)\n")  # fmt: skip
        print("### synced (ms, median of slowest rank)\n\n" + table(res, "synced") + "\n")
        print("### back-to-back (ms per operation)\n\n" + table(res, "back-to-back") + "\n")


if __name__ == "__main__":
    main()
