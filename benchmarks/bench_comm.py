"""paratrain.comm against the backend's own collectives: the runs quoted in BENCHMARKS.md.

Every figure comes from ``paratrain bench comm`` (run here as a subprocess, exactly as a user would), so
algorithms are compared within one run, interleaved iteration by iteration. Four runs:

1. ``sweep``: all_reduce, every algorithm, 1KB..256MB (x4): the busbw plot ``results/comm_busbw.png``;
2. ``collectives``: broadcast, reduce, all_gather, reduce_scatter, every algorithm, 1KB..32MB (x8):
   ``results/comm_busbw_collectives.png``;
3. ``large`` (repeated): ring vs native all_reduce at 16, 64 and 256 MB: the ring/native busbw ratio;
4. ``small`` (repeated): naive vs tree (vs native) all_reduce at 1-64 KB: the tree/naive speed ratio.

    python benchmarks/bench_comm.py --tag r2        # about 15 minutes on the 2-core CPU VM
    python benchmarks/bench_comm.py --quick --out /tmp/comm   # a smoke run: two sizes, few iterations

It prints markdown tables and writes the JSON of every run next to the plots: ``comm_{run}.json`` (with
``--tag T``: ``comm_{run}_T.json``). A stored file is never overwritten: pick a new tag. Each run records
its conditions (UTC start and end, 1-minute load average before and after, torch version, git commit).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from paratrain.bench.comm import format_size, plot, winners

RESULTS = Path(__file__).resolve().parent / "results"


def _utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _conditions() -> dict[str, Any]:
    """What the whole benchmark ran on: torch, the commit, the CPU count."""
    import torch

    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
        cwd=Path(__file__).resolve().parent,
    )  # fmt: skip
    return {"torch": torch.__version__, "commit": git.stdout.strip() or None, "cpus": os.cpu_count()}


def bench(args: list[str]) -> dict[str, Any]:
    """``paratrain bench comm ARGS --json`` as a subprocess; its JSON result with the run's time and load."""
    cmd = [sys.executable, "-m", "paratrain", "bench", "comm", *args, "--json"]
    print("$ paratrain bench comm " + " ".join(args), file=sys.stderr, flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start, load = _utc(), os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"paratrain bench comm failed ({proc.returncode}):\n{proc.stderr}")
    result = dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    result.update(utc_start=start, utc_end=_utc(), load_avg_before=load, load_avg_after=os.getloadavg()[0])
    return result


def rows_by(result: dict[str, Any]) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(r["collective"], r["bytes"], r["algorithm"]): r for r in result["results"]}


def table(result: dict[str, Any], collective: str) -> str:
    """Markdown: one row per size, time and busbw of every algorithm, the fastest marked."""
    rows = rows_by(result)
    algs = list(dict.fromkeys(r["algorithm"] for r in result["results"] if r["collective"] == collective))
    sizes = sorted({r["bytes"] for r in result["results"] if r["collective"] == collective})
    head = "| S | " + " | ".join(f"{a} ms (busbw GB/s)" for a in algs) + " | fastest |"
    lines = [head, "|" + "---|" * (len(algs) + 2)]
    for s in sizes:
        cells = {a: rows[(collective, s, a)] for a in algs}
        best = min(cells, key=lambda a: cells[a]["time_s"])
        text = [f"{c['time_s'] * 1e3:.2f} ({c['busbw_GBps']:.3f})" for c in cells.values()]
        lines.append(f"| {format_size(s)} | " + " | ".join(text) + f" | {best} |")
    return "\n".join(lines)


def ratio_table(runs: list[dict[str, Any]], num: str, den: str, metric: str) -> str:
    """Markdown: ``num``/``den`` per size and run (busbw ratio, or speed = time ratio), and the median."""
    sizes = sorted({r["bytes"] for r in runs[0]["results"]})
    head = "| S | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median |"
    lines = [head, "|" + "---|" * (len(runs) + 2)]
    for s in sizes:
        ratios = []
        for run in runs:
            rows = rows_by(run)
            a, b = rows[("all_reduce", s, num)], rows[("all_reduce", s, den)]
            ratios.append(
                a["busbw_GBps"] / b["busbw_GBps"] if metric == "busbw" else b["time_s"] / a["time_s"]
            )
        cells = " | ".join(f"{x:.2f}x" for x in ratios)
        lines.append(f"| {format_size(s)} | {cells} | **{statistics.median(ratios):.2f}x** |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="repeats of the two ratio runs")
    parser.add_argument("--quick", action="store_true", help="smoke run: few sizes and iterations")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default="", help="suffix of the file names: comm_{run}_TAG.json, .png")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = f"_{args.tag}" if args.tag else ""
    names = [f"comm_{run}{suffix}.json" for run in ("sweep", "collectives", "large", "small")]
    names += [f"comm_busbw{suffix}.png", f"comm_busbw_collectives{suffix}.png"]
    taken = [name for name in names if (args.out / name).exists()]
    if taken:
        raise SystemExit(
            f"{args.out} already holds {', '.join(taken)}: pass a new --tag (stored runs are kept)"
        )
    conditions = _conditions()
    n = ["--nproc-per-node", str(args.nproc)]
    quick = args.quick
    plan = {
        "sweep": [*n, "--sizes", "1KB,1MB" if quick else "1KB..256MB", "--factor", "4",
                  "--iters", "3" if quick else "10", "--warmup", "1" if quick else "2"],
        "collectives": [*n, "--collectives", "broadcast,reduce,all_gather,reduce_scatter",
                        "--sizes", "1KB,1MB" if quick else "1KB..32MB", "--factor", "8",
                        "--iters", "3" if quick else "10", "--warmup", "1" if quick else "2"],
        "large": [*n, "--algorithms", "ring,native", "--sizes", "1MB,4MB" if quick else "16MB,64MB,256MB",
                  "--iters", "3" if quick else "15", "--warmup", "1" if quick else "2"],
        "small": [*n, "--algorithms", "naive,tree,native", "--sizes", "1KB..64KB", "--factor", "4",
                  "--iters", "10" if quick else "200", "--warmup", "2" if quick else "10"],
    }  # fmt: skip
    results: dict[str, Any] = {}
    for name, flags in plan.items():
        repeats = args.repeats if name in ("large", "small") else 1
        results[name] = [bench(flags) for _ in range(repeats)]
        (args.out / f"comm_{name}{suffix}.json").write_text(
            json.dumps({"command": flags, "conditions": conditions, "runs": results[name]}, indent=1)
        )
    plot(results["sweep"][0], str(args.out / f"comm_busbw{suffix}.png"))
    plot(results["collectives"][0], str(args.out / f"comm_busbw_collectives{suffix}.png"))

    sweep = results["sweep"][0]
    m = sweep["model"]
    print(f"## all_reduce sweep ({sweep['world_size']} ranks, {sweep['backend']}/{sweep['device']})\n")
    print(
        f"α = {m['alpha_s'] * 1e6:.0f} us, β = {m['beta_s_per_byte'] * 1e9:.2f} ns/B, γ = {m['gamma_s_per_byte'] * 1e9:.3f} ns/B\n"
    )
    print(table(sweep, "all_reduce") + "\n")
    for collective in ("broadcast", "reduce", "all_gather", "reduce_scatter"):
        print(f"## {collective}\n\n" + table(results["collectives"][0], collective) + "\n")
    print(
        "## ring / native all_reduce busbw (≥ 16 MB target: 0.9x)\n\n"
        + ratio_table(results["large"], "ring", "native", "busbw")
        + "\n"
    )
    print(
        "## tree speed-up over naive all_reduce (small messages, target: 1.5x)\n\n"
        + ratio_table(results["small"], "tree", "naive", "time")
        + "\n"
    )
    print("## fastest algorithm by size\n")
    for res in (sweep, results["collectives"][0]):
        for collective, by_alg in winners(res).items():
            parts = [f"{alg}: {', '.join(format_size(s) for s in sizes)}" for alg, sizes in by_alg.items()]
            print(f"- {collective}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
