"""Shared-memory collectives (``paratrain.comm.shm``) against Gloo and paratrain's ring, side by side.

For 2 and 4 ranks on this host, for all_reduce, reduce_scatter and all_gather at 1 KB..256 MB (×4), every
algorithm runs once per iteration, interleaved in an order that rotates by one every iteration (results
stored before the rotation, the sweep ``shm.json`` and the ``*_fixed_order.json`` files, ran a fixed
order). The algorithms: ``shm`` as shipped (above 256 KiB, where the kernel allows the direct path, the
path each collective and size class takes is measured on its first calls: ``comm/_shm_tune.py``; before
the timed iterations of a size, ``shm`` makes those ``CALLS`` tuning calls, and each row records the path
chosen as ``shm_path``); ``shm-slots``, the slots only; ``shm-direct``, the direct path at every size (where
the kernel allows it); ``native``, Gloo's own collective; ``ring``, paratrain's pipelined ring; and for
all_reduce ``shm-zero-copy``, where the tensor lives in the segment's arena and is reduced where it lies,
as dp's gradient buckets are. Results stored before the tuning (``shm.json`` and the runs quoted with it
in BENCHMARKS.md) had ``shm`` on a fixed rule: direct above 256 KiB, above 2 MiB at 4 ranks on 2 cores.

Each call is timed alone (a Gloo barrier, then the call); an iteration's time is the slowest rank's; the
figure is the median over the iterations. With ``--back-to-back K`` a sample is K calls in a row after one
barrier, and its time is the total over K (nccl-tests' method: the barrier's exit skew between the ranks,
a property of Gloo's barrier and not of the collective, is spread over K calls instead of being added to
each). Each row also has the CPU seconds of the call summed over the ranks (``time.process_time``, every
thread of a rank: Gloo's own threads included), which on a loaded machine shows the work a call does more
steadily than its wall time (the scheduler shares cores per thread, and Gloo uses several). ``--runs R``
repeats everything in fresh process groups (rows carry ``run``). ``--cpu-bind cores`` pins rank r to its
block of cores as ``paratrain launch --cpu-bind cores`` does; ``both`` runs every run unpinned, then pinned
(rows carry ``cpu_bind``), so the two are measured side by side.

busbw = algbw × 2(n−1)/n for all_reduce and × (n−1)/n for reduce_scatter / all_gather, S the tensor (the
whole input of reduce_scatter, the whole output of all_gather): nccl-tests' definitions, from
:func:`paratrain.spec.cost.busbw`.

The memory-bandwidth limit is measured in the same script, on one core: a ``copy_`` of a large tensor
(bytes copied per second) and an ``add`` of two (bytes of one operand per second). A rank of the shm
all-reduce copies S in, reads S to reduce its chunk and copies S out, so on one core per rank its busbw
cannot pass about 2(n−1)/n × 1 / (1/copy + 1/read + 1/copy) of those figures (printed as the "limit");
with more ranks than cores (4 ranks on a 2-core VM) the ranks share the cores, and the limit halves. The
direct path (``shm``, when ``process_vm_readv`` is allowed; ``shm-slots`` is the same communicator with it
turned off) copies (n−1)/n·S in, adds S/n and copies (n−1)/n·S out: its limit is
2(n−1)/n / (2(n−1)/(n·copy) + 1/(n·add)).

    python benchmarks/bench_shm.py                        # the full sweep (about 7-10 minutes here)
    python benchmarks/bench_shm.py --quick                # smoke run: three sizes, few iterations
    python benchmarks/bench_shm.py --json --plot benchmarks/results/shm_busbw.png
    python benchmarks/bench_shm.py --json --sizes 1KB..1MB --iters 41 --back-to-back 20 \
        --algorithms shm,shm-slots,shm-zero-copy,native --out benchmarks/results/shm_small_b2b.json

``--json`` writes every raw row to ``benchmarks/results/shm.json`` (``--out`` elsewhere) and prints it as
one JSON line; the markdown tables go to stdout otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.shm.segment import DIRECT_BLOCK_BYTES
from paratrain.comm.shm.tune import CALLS as TUNING_CALLS
from paratrain.launch.cpu_bind import allowed_cores, core_blocks
from paratrain.spec.cost import busbw
from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
ALGORITHMS = ("shm", "shm-slots", "shm-direct", "shm-zero-copy", "native", "ring")


def parse_sizes(text: str, factor: int) -> list[int]:
    """``"1KB..256MB"`` (×factor) or ``"4KB,1MB"``; binary units."""
    units = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}

    def one(s: str) -> int:
        s = s.strip().upper()
        for u in ("KB", "MB", "GB", "B"):
            if s.endswith(u):
                return int(float(s[: -len(u)]) * units[u])
        return int(s)

    sizes: list[int] = []
    for item in text.split(","):
        if ".." in item:
            lo, hi = (one(x) for x in item.split(".."))
            while lo <= hi:
                sizes.append(lo)
                lo *= factor
        else:
            sizes.append(one(item))
    return sorted(set(sizes))


def fmt(nbytes: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.0f}{unit}"
    return f"{int(nbytes)}B"


def memory_bandwidth(nbytes: int, reps: int) -> dict[str, float]:
    """One core: ``dst.copy_(src)`` (bytes copied / s), ``torch.add(a, b, out=c)`` (bytes of one operand /
    s) and ``torch.sum`` over a (4, L) stack along dim 0 (bytes read / s), medians of ``reps``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    n = nbytes // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    stack, out = torch.ones(4, n // 4), torch.empty(n // 4)

    def med(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    res = {
        "bytes": float(nbytes),
        "copy_GBps": nbytes / med(lambda: c.copy_(a)) / 1e9,
        "add_GBps": nbytes / med(lambda: torch.add(a, b, out=c)) / 1e9,
        "sum_read_GBps": nbytes / med(lambda: torch.sum(stack, 0, out=out)) / 1e9,
    }
    torch.set_num_threads(threads)
    return res


def _inputs(collective: str, nbytes: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input, output) for S = ``nbytes`` float32, rounded down to whole elements per rank."""
    per_rank = max(1, nbytes // (4 * n))
    if collective == "all_reduce":
        return torch.zeros(per_rank * n), None  # zeros: repeated sums stay finite
    if collective == "reduce_scatter":
        return torch.zeros(per_rank * n), torch.empty(per_rank)
    return torch.zeros(per_rank), torch.empty(per_rank * n)


def _calls(
    collective: str,
    algorithms: list[str],
    c: Any,
    inp: torch.Tensor,
    out: torch.Tensor | None,
    slots: Any,
    direct: Any,
) -> dict[str, Callable[[], Any]]:
    """One zero-argument call per algorithm that offers ``collective``."""
    from paratrain import comm

    calls: dict[str, Callable[[], Any]] = {}
    if collective == "all_reduce":
        table: dict[str, Callable[[], Any]] = {
            "shm": lambda: c.all_reduce(inp),
            "shm-slots": lambda: slots.all_reduce(inp),
            "shm-direct": lambda: direct.all_reduce(inp),
            "native": lambda: dist.all_reduce(inp),
            "ring": lambda: comm.all_reduce(inp, "sum", "ring", check=False),
        }
        if "shm-zero-copy" in algorithms:
            c.reset_arena()
            slot = c.allocate(inp.shape)
            slot.zero_()
            table["shm-zero-copy"] = lambda: c.all_reduce_inplace_slot(slot)
    elif collective == "reduce_scatter":
        table = {
            "shm": lambda: c.reduce_scatter(out, inp),
            "shm-slots": lambda: slots.reduce_scatter(out, inp),
            "shm-direct": lambda: direct.reduce_scatter(out, inp),
            "native": lambda: dist.reduce_scatter_single(out, inp),
            "ring": lambda: comm.reduce_scatter(inp, "sum", "ring", check=False),
        }
    else:
        table = {
            "shm": lambda: c.all_gather(out, inp),
            "shm-slots": lambda: slots.all_gather(out, inp),
            "shm-direct": lambda: direct.all_gather(out, inp),
            "native": lambda: dist.all_gather_single(out, inp),
            "ring": lambda: comm.all_gather(inp, "ring", check=False),
        }
    for alg in algorithms:
        if alg in table:
            calls[alg] = table[alg]
    return calls


def _worker(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One rank: every collective × size, the algorithms interleaved; returns rank 0's rows (all equal)."""
    from paratrain.comm import shm

    n = dist.get_world_size()
    if spec["bind"]:  # as `paratrain launch --cpu-bind cores` places local rank r
        os.sched_setaffinity(0, core_blocks(allowed_cores(), n)[dist.get_rank()])
    zero_copy = "shm-zero-copy" in spec["algorithms"]
    c = shm.ShmCommunicator(
        capacity_bytes=spec["capacity"],
        arena_bytes=max(spec["sizes"]) if zero_copy else 0,
        direct_block_bytes=spec["direct_block"],
    )
    slots = (
        shm.ShmCommunicator(capacity_bytes=spec["capacity"], direct=False)
        if "shm-slots" in spec["algorithms"]
        else None
    )
    direct = (
        shm.ShmCommunicator(capacity_bytes=spec["capacity"], direct_min_bytes=0)  # fixed: never tuned
        if "shm-direct" in spec["algorithms"]
        else None
    )
    rows = []
    for collective in spec["collectives"]:
        for size in spec["sizes"]:
            inp, out = _inputs(collective, size, n)
            calls = _calls(collective, spec["algorithms"], c, inp, out, slots, direct)
            if direct is not None and not direct.direct:
                calls.pop("shm-direct", None)  # the kernel refused process_vm_readv: no such path here
            for _ in range(TUNING_CALLS):  # shm as shipped measures its path on a size's first calls
                dist.barrier()
                calls["shm"]()
            path = _tuned_path(c, collective, inp if out is None or collective == "reduce_scatter" else out)
            iters = spec["iters"] if size < spec["big_bytes"] else spec["big_iters"]
            times: dict[str, list[float]] = {a: [] for a in calls}
            cpu: dict[str, list[float]] = {a: [] for a in calls}
            k = spec["back_to_back"]
            names = list(calls)
            for it in range(spec["warmup"] + iters):
                # interleaved, so every algorithm sees the same machine state, in an order that rotates
                # every iteration, so each runs in every position equally often
                for alg in names[it % len(names) :] + names[: it % len(names)]:
                    call = calls[alg]
                    dist.barrier()
                    t, c0 = time.perf_counter(), time.process_time()
                    for _ in range(k):  # k > 1: back to back, the barrier's exit skew spread over k calls
                        call()
                    dt = (time.perf_counter() - t) / k
                    if it >= spec["warmup"]:
                        times[alg].append(dt)
                        cpu[alg].append((time.process_time() - c0) / k)  # every thread (Gloo's too)
            table = torch.tensor([times[a] for a in calls], dtype=torch.float64)
            dist.all_reduce(table, op=dist.ReduceOp.MAX)  # an iteration ends when its slowest rank does
            cpu_table = torch.tensor([cpu[a] for a in calls], dtype=torch.float64)
            dist.all_reduce(cpu_table)  # CPU seconds summed over the ranks
            nbytes = inp.numel() * 4 * (n if collective == "all_gather" else 1)
            for alg, per_iter, per_cpu in zip(calls, table.tolist(), cpu_table.tolist(), strict=True):
                t = statistics.median(per_iter)
                rows.append({
                    "world_size": n, "collective": collective, "algorithm": alg, "bytes": nbytes,
                    "time_s": t, "min_s": min(per_iter), "max_s": max(per_iter), "iters": len(per_iter),
                    "busbw_GBps": busbw(collective, n, nbytes, t) / 1e9,
                    "cpu_s_all_ranks": statistics.median(per_cpu), "calls_per_sample": k,
                    **({"shm_path": path} if alg == "shm" else {}),
                })  # fmt: skip
    for comm in (c, slots, direct):
        if comm is not None:
            comm.close()
    return rows


def _tuned_path(c: Any, collective: str, t: torch.Tensor) -> str:
    """The path ``shm`` (as shipped) takes for ``t`` in ``collective`` after its tuning calls."""
    if not c.direct:
        return "slots (no direct path here)"
    return str(c.path(collective, t.numel() * t.element_size()))


def shm_limit(membw: dict[str, float], n: int, cores: int) -> float:
    """busbw bound of the shm all-reduce on one core per rank (module docstring), shared cores scaled."""
    per_byte = 2 / membw["copy_GBps"] + 1 / membw["sum_read_GBps"]  # copy in + copy out + reduce (s/GB)
    share = min(1.0, cores / n)
    return 2 * (n - 1) / n / per_byte * share


def direct_limit(membw: dict[str, float], n: int, cores: int) -> float:
    """busbw bound of the direct (cross-memory attach) all-reduce on one core per rank: (n-1)/n·S copied
    in, S/n reduced (an ``add`` of this rank's chunk with the peers' blocks, which are in cache), (n-1)/n·S
    copied out; shared cores scaled."""
    per_byte = 2 * (n - 1) / n / membw["copy_GBps"] + 1 / n / membw["add_GBps"]
    share = min(1.0, cores / n)
    return 2 * (n - 1) / n / per_byte * share


def tables(result: dict[str, Any]) -> str:
    out = []
    cores = result["machine"]["cores"]
    runs = sorted({r.get("run", 0) for r in result["rows"]})
    binds = sorted({r.get("cpu_bind", False) for r in result["rows"]})
    for run, n, bind in ((run, n, b) for run in runs for n in result["world_sizes"] for b in binds):
        limit = shm_limit(result["membw"], n, cores)
        for collective in result["collectives"]:
            rows = [
                r for r in result["rows"]
                if r["world_size"] == n and r["collective"] == collective and r.get("run", 0) == run
                and r.get("cpu_bind", False) == bind
            ]  # fmt: skip
            if not rows:
                continue
            algs = list(dict.fromkeys(r["algorithm"] for r in rows))
            by = {(r["algorithm"], r["bytes"]): r for r in rows}
            head = (
                "| S | "
                + " | ".join(f"{a} ms (busbw GB/s)" for a in algs)
                + " | shm / native busbw | shm path |"
            )
            lines = [
                f"### {collective}, {n} ranks on {cores} cores"
                + (f", run {run + 1}" if len(runs) > 1 else "")
                + (", pinned (--cpu-bind cores)" if bind else ""),
                "",
                head,
                "|" + "---|" * (len(algs) + 3),
            ]
            for s in sorted({r["bytes"] for r in rows}):
                cells = [f"{by[a, s]['time_s'] * 1e3:.3f} ({by[a, s]['busbw_GBps']:.2f})" for a in algs]
                ratio = (
                    by["shm", s]["busbw_GBps"] / by["native", s]["busbw_GBps"] if ("native", s) in by else 0
                )
                path = by["shm", s].get("shm_path", "-")
                lines.append(f"| {fmt(s)} | " + " | ".join(cells) + f" | **{ratio:.2f}x** | {path} |")
            if collective == "all_reduce":
                lines.append(
                    f"\nmemory-bandwidth limits (model), busbw: through the slots {limit:.2f} GB/s, direct "
                    f"{direct_limit(result['membw'], n, cores):.2f} GB/s"
                )
            out.append("\n".join(lines))
    return "\n\n".join(out)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = result["collectives"]
    colors = dict(
        zip(
            ALGORITHMS,
            ("tab:blue", "tab:purple", "tab:red", "tab:cyan", "tab:orange", "tab:green"),
            strict=True,
        )
    )
    fig, axes = plt.subplots(1, len(colls), figsize=(6 * len(colls), 4.4), squeeze=False)
    for ax, collective in zip(axes[0], colls, strict=True):
        for n in result["world_sizes"]:
            rows = [
                r
                for r in result["rows"]
                if r["world_size"] == n and r["collective"] == collective and r.get("run", 0) == 0
            ]  # fmt: skip (the first run)
            for alg in dict.fromkeys(r["algorithm"] for r in rows):
                pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["algorithm"] == alg)
                style = "-" if n == min(result["world_sizes"]) else "--"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, color=colors[alg],
                        linestyle=style, label=f"{alg}, {n} ranks")  # fmt: skip
        ax.axhline(
            result["membw"]["copy_GBps"], color="grey", linewidth=0.8, linestyle=":", label="1-core copy"
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size S (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{collective} ({result['machine']['cores']} cores)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4", help="world sizes, comma-separated (default 2,4)")
    parser.add_argument("--sizes", default="1KB..256MB", help="sizes S: 1KB..256MB (×--factor) or 4KB,1MB")
    parser.add_argument("--factor", type=int, default=4)
    parser.add_argument("--collectives", default=",".join(COLLECTIVES))
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--iters", type=int, default=15, help="timed iterations per size (median)")
    parser.add_argument("--big-iters", type=int, default=5, help="timed iterations at >= 32 MB")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--runs", type=int, default=1, help="repeat the whole sweep in fresh process groups")
    parser.add_argument(
        "--back-to-back", type=int, default=1, metavar="K",
        help="time K calls in a row per sample, after one barrier, and report the time per call "
        "(nccl-tests' way; default 1: each call alone after its own barrier)",
    )  # fmt: skip
    parser.add_argument("--capacity", type=int, default=8 << 20, help="shm slot bytes (default 8 MiB)")
    parser.add_argument(
        "--direct-block",
        type=int,
        default=DIRECT_BLOCK_BYTES,
        help="shm direct-path block bytes, all peers together (1 MiB)",
    )
    parser.add_argument(
        "--cpu-bind", choices=("none", "cores", "both"), default="none",
        help="pin the ranks to cores as `paratrain launch --cpu-bind cores` does (every algorithm alike); "
        "both: each run twice, unpinned then pinned",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: 4KB,1MB,16MB, 3 iterations")
    parser.add_argument("--json", action="store_true", help="write the raw rows to --out and print them")
    parser.add_argument("--out", type=Path, default=RESULTS / "shm.json")
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="busbw against size, one panel per collective"
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.iters, args.big_iters, args.warmup = "4KB,1MB,16MB", 3, 3, 1
    sizes = parse_sizes(args.sizes, args.factor)
    world_sizes = [int(x) for x in args.ranks.split(",")]
    collectives = [x for x in args.collectives.split(",") if x]
    algorithms = [x for x in args.algorithms.split(",") if x]
    bad = [c for c in collectives if c not in COLLECTIVES] + [a for a in algorithms if a not in ALGORITHMS]
    if args.runs < 1:
        raise SystemExit(f"--runs must be at least 1, got {args.runs}")
    if args.back_to_back < 1:
        raise SystemExit(
            f"--back-to-back must be at least 1 (calls per timed sample), got {args.back_to_back}"
        )
    if bad or "shm" not in algorithms or "native" not in algorithms:
        raise SystemExit(
            f"unknown or missing names {bad}; collectives {COLLECTIVES}, algorithms {ALGORITHMS} "
            "(shm and native are needed)"
        )
    membw = memory_bandwidth(min(64 << 20, max(sizes)) if not args.quick else 16 << 20, 5)
    print(
        f"one core: copy {membw['copy_GBps']:.2f} GB/s, add {membw['add_GBps']:.2f} GB/s, "
        f"4-way sum {membw['sum_read_GBps']:.2f} GB/s read",
        file=sys.stderr,
    )
    spec = {
        "sizes": sizes, "collectives": collectives, "algorithms": algorithms, "iters": args.iters,
        "big_iters": args.big_iters, "big_bytes": 32 << 20, "warmup": args.warmup, "capacity": args.capacity,
        "direct_block": args.direct_block, "back_to_back": args.back_to_back,
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    env = {"OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()
    binds = {"none": [False], "cores": [True], "both": [False, True]}[args.cpu_bind]
    for run in range(args.runs):  # each run: fresh process groups and segments
        for n in world_sizes:
            for bind in binds:
                print(f"run {run + 1}/{args.runs}: {n} ranks{' pinned' if bind else ''} ...", file=sys.stderr,
                      flush=True)  # fmt: skip
                rows += [
                    {**row, "run": run, "cpu_bind": bind}
                    for row in run_distributed(
                        _worker, n, args=({**spec, "bind": bind},), timeout_s=7200, env=env
                    )[0]
                ]
    result = {
        "machine": {"cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "membw": membw, "world_sizes": world_sizes, "collectives": collectives, "spec": spec,
        "shm_all_reduce_limit_GBps": {str(n): shm_limit(membw, n, os.cpu_count() or 1) for n in world_sizes},
        "direct_all_reduce_limit_GBps": {
            str(n): direct_limit(membw, n, os.cpu_count() or 1) for n in world_sizes
        },
        "cpu_bind": args.cpu_bind, "load_avg_before": load_before, "load_avg_after": os.getloadavg(), "rows": rows,
    }  # fmt: skip
    if args.plot:
        plot(result, args.plot)
    if args.json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result))
    else:
        print(tables(result))


if __name__ == "__main__":
    main()
