"""``--activation-checkpointing none | selective | full`` under every strategy, run as a user runs them.

For each strategy (data-parallel, model-parallel, their compositions, expert-parallel on an MoE model) it runs
``paratrain train ... --json`` three times, once per mode, with the same seed and data (CPU, Gloo, fp32 AdamW,
3 steps) and stores each run's losses, ``param_sha256`` and ``peak_bytes_per_rank`` (MemTracker over one
step). A row holds when selective trains like none (the same losses within 1e-5 and the same final parameters)
and its peak lies between full's and none's (``full <= selective <= none``; MoE models at this size peak at the
optimizer step, where the three are equal).

    python benchmarks/bench_selective_ac.py [--json benchmarks/results/selective_ac_grid.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

DENSE = ["--model", "llama-debug", "--set", "model.dim=32", "model.n_layers=4", "model.ffn_hidden=64",
         "model.n_heads=4", "model.n_kv_heads=2"]  # fmt: skip
MOE = ["--model", "llama-moe-debug"]
COMMON = ["--data", "python-stdlib", "--set", "data.max_bytes=20000", "--seq-len", "64", "--batch-size", "8",
          "--steps", "3", "--seed", "0", "--resume", "never", "--json"]  # fmt: skip

GRID: list[tuple[list[str], str, int, list[str]]] = [
    (DENSE, "ddp", 2, []),
    (DENSE, "dp", 2, []),
    (DENSE, "zero1", 2, []),
    (DENSE, "zero2", 2, []),
    (DENSE, "zero3", 2, []),
    (DENSE, "hsdp", 4, ["--dp-replicate", "2", "--dp-shard", "2"]),
    (DENSE, "tp", 2, []),
    (DENSE, "fsdp+tp", 4, ["--tp", "2"]),
    (DENSE, "pp", 2, []),
    (DENSE, "pp", 2, ["--pp-schedule", "interleaved-1f1b"]),
    (DENSE, "fsdp+pp", 4, ["--pp", "2"]),
    (DENSE, "fsdp+tp+pp", 4, ["--tp", "2", "--pp", "2"]),
    (MOE, "ep", 2, []),
    (MOE, "fsdp+ep", 2, []),
    (MOE, "fsdp+tp+ep", 4, ["--tp", "2", "--ep", "2"]),
    (MOE, "fsdp+ep+pp", 4, ["--pp", "2", "--ep", "2"]),
]
MODES = ("none", "selective", "full")


def _run(argv: list[str], run_dir: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", *argv, "--run-dir", run_dir],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        return {"error": (out.stderr or out.stdout)[-800:]}
    return dict(json.loads(lines[-1]))


def row(model: list[str], strategy: str, nproc: int, extra: list[str], root: str) -> dict[str, Any]:
    runs = {}
    for mode in MODES:
        argv = [*model, *COMMON, "--strategy", strategy, "--nproc-per-node", str(nproc), *extra,
                "--activation-checkpointing", mode]  # fmt: skip
        runs[mode] = _run(argv, os.path.join(root, f"{strategy}-{nproc}-{len(extra)}-{mode}"))
    out: dict[str, Any] = {"model": model[1], "strategy": strategy, "nproc": nproc, "flags": extra}
    if any("error" in r for r in runs.values()):
        out["errors"] = {m: r["error"] for m, r in runs.items() if "error" in r}
        out["holds"] = False
        return out
    for mode, r in runs.items():
        out[mode] = {
            "losses": r["losses"],
            "param_sha256": r["param_sha256"],
            "peak_bytes_per_rank": r["peak_bytes_per_rank"],
        }
    none, sel, full = (runs[m] for m in MODES)
    out["same_training"] = sel["param_sha256"] == none["param_sha256"] and all(
        abs(a - b) <= 1e-5 + 1e-5 * abs(b) for a, b in zip(sel["losses"], none["losses"], strict=True)
    )
    out["peak_between"] = (
        full["peak_bytes_per_rank"] <= sel["peak_bytes_per_rank"] <= none["peak_bytes_per_rank"]
    )
    out["holds"] = out["same_training"] and out["peak_between"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", nargs="?", const="benchmarks/results/selective_ac_grid.json")
    ap.add_argument("--strategies", nargs="*", help="only these strategies (default: the whole grid)")
    args = ap.parse_args()
    load_start = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for model, strategy, nproc, extra in GRID:
            if args.strategies and strategy not in args.strategies:
                continue
            r = row(model, strategy, nproc, extra, root)
            rows.append(r)
            peaks = " / ".join(f"{r[m]['peak_bytes_per_rank']:,}" for m in MODES if m in r)
            print(f"{r['model']:16s} {strategy:11s} {nproc} {' '.join(extra):28s} "
                  f"{'holds' if r['holds'] else 'FAILS'}  peaks none / selective / full: {peaks}", flush=True)  # fmt: skip
    conditions = {"device": "cpu", "backend": "gloo", "precision": "fp32", "steps": 3, "seq_len": 64,
                  "batch_size": 8, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "load_avg_start": load_start, "load_avg_end": os.getloadavg()}  # fmt: skip
    result = {"benchmark": "bench_selective_ac", "conditions": conditions, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0 if all(r["holds"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
