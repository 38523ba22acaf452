"""zero2's measured step peak at the default bucket size against ddp's and against 4Ψ + 12Ψ/N + one bucket.

``paratrain train`` as a user runs it (3 CPU ranks, Gloo, fp32 AdamW, ``--bucket-cap-mb`` left at its
default), on an MLP 64 → 2048×5 → 10 (Ψ = 16,939,018), per-rank batch 8, 3 steps; the figure is the
summary's ``peak_bytes_per_rank`` (MemTracker over one step). Also stored: the formula's terms, with the
largest bucket's full-size send buffer as "one bucket" (activations: under 0.6 MB at this batch, left out),
and the planner's predicted peak for the same run. Records with ``"reduce": "all_reduce in place"`` measure
the bucket all-reduced in place on Gloo (no copy of it) and one all-gather buffer at a time; the first
record, without it, measured Gloo's reduce-scatter (a copy of the bucket) and two gather buffers.

    python benchmarks/bench_zero2_default.py --json   # appends a run to benchmarks/results/zero2_default.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = ["--model", "mlp", "--set", "model.hidden=2048", "--set", "model.layers=5", "--batch-size", "24"]
RANKS = 3


def _train(strategy: str, run_dir: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", *MODEL, "--steps", "3", "--strategy", strategy,
         "--nproc-per-node", str(RANKS), "--run-dir", run_dir, "--resume", "never", "--json"],
        capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _planned_peak() -> float:
    """``paratrain plan``'s peak per rank for the run (the launch guard plans an MLP by its states only)."""
    out = subprocess.run(
        [sys.executable, "-m", "paratrain", "plan", *MODEL, "--strategy", "zero2", "--nproc-per-node", str(RANKS),
         "--cluster", "cpu-local", "--json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1])["plans"][0]["bytes_per_rank"]["peak"])


def _largest_bucket_bytes() -> float:
    from paratrain.testing import run_distributed

    return float(max(run_distributed(_bucket_bytes, RANKS, timeout_s=300)))


def _bucket_bytes() -> float:
    import torch

    from paratrain.models.mlp import MLP
    from paratrain.parallel import setup
    from paratrain.runtime import init

    ctx = init(seed=0)
    model = MLP(64, 2048, 5, 10)
    _m, opt, _ = setup(model, torch.optim.AdamW(model.parameters()), strategy="zero2", ctx=ctx)
    return max(b.segment * ctx.world_size * 4 for b in opt.buckets)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        ddp = _train("ddp", f"{tmp}/ddp")
        zero2 = _train("zero2", f"{tmp}/zero2")
    psi, n = zero2["num_params"], RANKS
    bucket = _largest_bucket_bytes()
    formula = 4 * psi + 12 * psi / n + bucket
    peak = zero2["peak_bytes_per_rank"]
    record = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "conditions": {
            "ranks": RANKS,
            "cores": os.cpu_count(),
            "loadavg_before": load,
            "model": MODEL,
            "note": "shared 2-core machine, loaded by other engineers' work",
        },
        "psi": psi,
        "ddp_peak_bytes": ddp["peak_bytes_per_rank"],
        "zero2_peak_bytes": peak,
        "zero2_over_ddp": peak / ddp["peak_bytes_per_rank"],
        "one_bucket_bytes": bucket,
        "formula_4psi_12psi_over_n_bucket": formula,
        "zero2_over_formula": peak / formula,
        "reduce": "all_reduce in place",
        "guard_predicted_peak_bytes": zero2.get("predicted_peak_bytes_per_rank"),  # states only (an MLP)
        "planned_peak_bytes": _planned_peak(),
    }
    print(
        f"zero2 {peak / 1e6:.1f} MB, ddp {ddp['peak_bytes_per_rank'] / 1e6:.1f} MB "
        f"({record['zero2_over_ddp']:.2f}x); 4Ψ + 12Ψ/N + one bucket = {formula / 1e6:.1f} MB "
        f"({record['zero2_over_formula']:.2f}x); paratrain plan {record['planned_peak_bytes'] / 1e6:.1f} MB"
    )
    if args.json:
        path = RESULTS / "zero2_default.json"
        old = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps([*old, record], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
