"""Where the ring's extra CPU goes against Gloo's all-reduce at 16 MB on 4 ranks: a whole-system ``perf``.

Each sample is one process group of ``--ranks`` ranks that makes ``--iters`` calls of one all-reduce,
either Gloo's (``native``) or paratrain's ring (``ring``), under ``perf record -a`` (every CPU, kernel
included, 999 Hz). The two take turns, ``--pairs`` times, in alternating order. ``perf report`` gives the
samples per symbol; they are grouped into:

- ``kernel: socket receive copy`` (``_copy_to_iter``: the kernel copying received bytes to the process),
- ``kernel: socket send copy`` (``_copy_from_iter``),
- ``kernel: idle`` (the CPUs halted: nothing to run),
- ``kernel: other``,
- ``reduction`` (``gloo::sum`` and ATen's vectorised ``add`` loop),
- ``python`` (the interpreter), ``pybind/c10d`` (``libtorch_python``, ``libc10``), ``user: other``.

Start-up (imports, process creation) is in every sample alike; the loop is the difference. Also stored:
the wall time per call (slowest rank) and the CPU per call summed over the ranks, from the workers.

It needs ``perf`` and ``/proc/sys/kernel/perf_event_paranoid`` at 1 or below (kernel symbols): as root,
``sysctl kernel.perf_event_paranoid=1``.

    python benchmarks/profile_ring.py --json      # 3 pairs, about 3 minutes; writes results/ring16_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1 << 20
LINE = re.compile(r"^\s*([\d.]+)%\s+(\d+)\s+(\S+)\s+\[([.k])\]\s+(.*?)\s*$")


def _loop(which: str, iters: int, size: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from paratrain.comm import ring
    from paratrain.comm._common import peers

    torch.set_num_threads(1)
    p = peers("profile", None)
    x = torch.zeros(size // 4)
    call = (lambda: dist.all_reduce(x)) if which == "native" else (lambda: ring.all_reduce(x, "sum", p))
    for _ in range(3):
        call()
    dist.barrier()
    t0, c0 = time.perf_counter(), os.times()
    for _ in range(iters):
        call()
    dist.barrier()
    t1, c1 = time.perf_counter(), os.times()
    return {
        "wall_s": (t1 - t0) / iters,
        "user_s": (c1.user - c0.user) / iters,
        "sys_s": (c1.system - c0.system) / iters,
    }


def _worker_main(which: str, ranks: int, iters: int, size: int) -> None:
    from paratrain.testing import run_distributed

    out = run_distributed(
        _loop, ranks, args=(which, iters, size), timeout_s=900, env={"OMP_NUM_THREADS": "1"}
    )
    print(json.dumps({
        "time_per_call_s": max(o["wall_s"] for o in out),
        "user_s_per_call_all_ranks": sum(o["user_s"] for o in out),
        "sys_s_per_call_all_ranks": sum(o["sys_s"] for o in out),
    }))  # fmt: skip


def _category(dso: str, kind: str, symbol: str) -> str:
    if kind == "k":
        if symbol.startswith("_copy_to_iter"):
            return "kernel: socket receive copy"
        if symbol.startswith("_copy_from_iter"):
            return "kernel: socket send copy"
        if "safe_halt" in symbol or "idle" in symbol:
            return "kernel: idle"
        return "kernel: other"
    if "gloo::sum" in symbol or ("add_kernel" in symbol and "Vectorized" in symbol):
        return "reduction"
    if dso.startswith("libpython"):
        return "python"
    if dso.startswith(("libtorch_python", "libc10.")):
        return "pybind/c10d"
    return "user: other"


def _profile(which: str, ranks: int, iters: int, size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="paratrain-perf-") as tmp:
        data = os.path.join(tmp, "perf.data")
        cmd = ["perf", "record", "-F", "999", "-a", "-q", "-o", data, "--", sys.executable, __file__,
               "--worker", which, "--ranks", str(ranks), "--iters", str(iters), "--size-mb", str(size // MB)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if run.returncode != 0:
            raise SystemExit(f"perf record failed ({run.returncode}):\n{run.stderr[-2000:]}")
        timing = json.loads(run.stdout.strip().splitlines()[-1])
        report = subprocess.run(
            ["perf", "report", "-i", data, "--no-children", "--sort", "dso,symbol", "-n", "--stdio"],
            capture_output=True, text=True, timeout=600, check=True,
        ).stdout  # fmt: skip
    symbols: list[dict[str, Any]] = []
    categories: dict[str, int] = {}
    for line in report.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        samples, dso, kind, symbol = int(m.group(2)), m.group(3), m.group(4), m.group(5)
        cat = _category(dso, kind, symbol)
        categories[cat] = categories.get(cat, 0) + samples
        symbols.append(
            {"samples": samples, "dso": dso, "kind": kind, "symbol": symbol[:160], "category": cat}
        )
    return {"variant": which, **timing, "total_samples": sum(categories.values()), "categories": categories,
            "top_symbols": symbols[:40]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--size-mb", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--worker", choices=("native", "ring"), help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS / "ring16_profile.json")
    args = ap.parse_args()
    size = args.size_mb * MB
    if args.worker:
        _worker_main(args.worker, args.ranks, args.iters, size)
        return
    if shutil.which("perf") is None:
        raise SystemExit("perf is not installed (Debian: apt-get install linux-perf).")
    paranoid = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    if paranoid > 1:
        raise SystemExit(
            f"kernel.perf_event_paranoid is {paranoid}: kernel symbols need 1 or below "
            "(as root: sysctl kernel.perf_event_paranoid=1)."
        )
    samples = []
    for pair in range(args.pairs):
        for which in ("native", "ring") if pair % 2 == 0 else ("ring", "native"):
            row = _profile(which, args.ranks, args.iters, size)
            row["pair"] = pair + 1
            samples.append(row)
            cats = ", ".join(f"{k} {v}" for k, v in sorted(row["categories"].items(), key=lambda kv: -kv[1]))
            print(f"pair {pair + 1} {which}: {row['time_per_call_s'] * 1e3:.1f} ms per call; samples: {cats}",
                  file=sys.stderr)  # fmt: skip
    summary = {}
    for which in ("native", "ring"):
        rows = [s for s in samples if s["variant"] == which]
        cats = sorted({c for r in rows for c in r["categories"]})
        summary[which] = {
            "time_per_call_ms_median": statistics.median(r["time_per_call_s"] * 1e3 for r in rows),
            "samples_median": {c: statistics.median(r["categories"].get(c, 0) for r in rows) for c in cats},
        }
    doc = {"ranks": args.ranks, "iters": args.iters, "size_bytes": size, "cores": os.cpu_count(),
           "perf_hz": 999, "samples": samples, "summary": summary}  # fmt: skip
    if args.json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
