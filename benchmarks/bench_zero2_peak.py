"""zero2's peak gradient memory during a step, measured with torch's MemTracker: now against the old schedule.

The model of ``benchmarks/bench_zero.py`` (MLP 64 → 1024×6 → 10, Ψ = 5,324,810), fp32 AdamW, per-rank batch
32, ``--bucket-cap-mb`` buckets. One warm-up step, then one step under ``MemTracker``; at every gradient
hook (after zero2's own) the tracker's current Gradient + Temp bytes are read, and the largest is the
peak gradient memory of the step: the full gradients not yet packed, the full-size send buffers, and the
reduced 4Ψ/N shards. Also reported: MemTracker's peak of every live byte during the step (``Total``),
the figure the trainer's ``peak_bytes_per_rank`` is.

- ``now``: a bucket's send buffer is freed as soon as its reduce-scatter is done (at most
  ``zero.MAX_IN_FLIGHT`` alive at once);
- ``before``: the schedule before the fix, emulated in the same process by keeping every send buffer
  until ``step()``.

    python benchmarks/bench_zero2_peak.py --json     # 2 ranks; writes benchmarks/results/zero2_peak.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"


def _measure(schedule: str, algorithm: str, cap_mb: float) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker

    from paratrain.models.mlp import MLP
    from paratrain.parallel import setup, zero
    from paratrain.runtime import init

    if schedule == "before":  # every send buffer kept until step(): retire nothing in the hooks
        retire = zero.ShardedOptimizer._retire
        zero.ShardedOptimizer._retire = lambda self, keep: retire(self, keep) if keep == 0 else None  # type: ignore[method-assign]
    ctx = init(seed=0)
    torch.manual_seed(0)
    model: nn.Module = MLP(64, 1024, 6, 10)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = setup(
        model, opt, strategy="zero2", ctx=ctx, bucket_cap_mb=cap_mb, comm_algorithm=algorithm
    )
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    tracker = MemTracker()
    tracker.track_external(model, opt, opt.optim)
    samples: list[int] = []

    def sample(_p: torch.Tensor) -> None:
        snap = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        samples.append(sum(v for k, v in snap.items() if getattr(k, "value", "") in ("Gradient", "Temp")))

    hooks = [p.register_post_accumulate_grad_hook(sample) for p in model.parameters()]
    with tracker:
        step()
    for h in hooks:
        h.remove()
    psi = sum(p.numel() for p in model.parameters())
    total = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return {
        "schedule": schedule, "algorithm": algorithm, "bucket_cap_mb": cap_mb, "buckets": len(opt.buckets),
        "world_size": ctx.world_size, "psi": psi, "peak_grad_bytes": max(samples),
        "peak_grad_in_4psi": max(samples) / (4 * psi), "peak_total_bytes": int(total),
        "formula_4psi_over_n_plus_buckets_in_4psi": 1 / ctx.world_size
        + (zero.MAX_IN_FLIGHT + 1) / max(1, len(opt.buckets)),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--bucket-cap-mb", default="2,25")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for cap in [float(c) for c in args.bucket_cap_mb.split(",")]:
        for algorithm in ("native", "shm"):
            for schedule in ("now", "before"):
                r = run_distributed(_measure, args.ranks, args=(schedule, algorithm, cap), timeout_s=300)
                rows.append(max(r, key=lambda d: d["peak_grad_bytes"]))
                d = rows[-1]
                print(
                    f"cap {cap:g} MiB ({d['buckets']} buckets), {algorithm}, {schedule}: peak gradient memory "
                    f"{d['peak_grad_bytes'] / 2**20:.1f} MiB = {d['peak_grad_in_4psi']:.2f} x 4Psi; "
                    f"MemTracker peak total {d['peak_total_bytes'] / 2**20:.1f} MiB"
                )
    if args.json:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "zero2_peak.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
