"""One AdamW step by torch's three kernels (``optimizer.implementation``), CPU time per step, side by side.

The parameters have the shapes of bench_hf.py's 97.5 M-parameter ``LlamaForCausalLM`` (hidden 768, 12
layers, MLP 2048, vocabulary 8192, untied head): the whole model (``single``) or the half each of 2 ranks
holds under ``zero3`` (``--shard 2``: every tensor's first half). Gradients are random; AdamW with
paratrain's defaults (betas 0.9/0.999, weight decay 0). ``--repeats`` rounds, each timing ``--steps`` steps
of every kernel in turn (the order rotates per round), one thread. Also recorded: the largest relative
difference of the parameters after the steps between ``fused`` and ``for-loop`` (float rounding only).

    python benchmarks/bench_optimizer.py --json     # writes benchmarks/results/optimizer_kernels.json
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

RESULTS = Path(__file__).resolve().parent / "results"
KERNELS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def llama_shapes(
    hidden: int = 768, layers: int = 12, ffn: int = 2048, vocab: int = 8192
) -> list[tuple[int, ...]]:
    block = [(hidden, hidden)] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return [(vocab, hidden)] + block * layers + [(hidden,), (vocab, hidden)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shard", type=int, default=2, help="hold 1/N of each tensor (zero3's rank); 1: all")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--out", default=str(RESULTS / "optimizer_kernels.json"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    g = torch.Generator().manual_seed(0)
    shapes = [(max(1, s[0] // args.shard), *s[1:]) for s in llama_shapes()]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * 1e-2 for s in shapes]
    runs: dict[str, Any] = {}
    for name, kw in KERNELS.items():
        params = [torch.nn.Parameter(t.clone()) for t in init]
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        runs[name] = (params, torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, **kw))
    cpu: dict[str, list[float]] = {k: [] for k in KERNELS}
    names = list(KERNELS)
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            opt = runs[name][1]
            for _ in range(args.steps):
                c0 = time.process_time()
                opt.step()
                cpu[name].append(time.process_time() - c0)
    ref = runs["for-loop"][0]
    diff = max(
        float(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item())
        for a, b in zip(runs["fused"][0], ref, strict=True)
    )
    median = {k: statistics.median(v) for k, v in cpu.items()}
    result = {
        "benchmark": "bench_optimizer",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "conditions": {
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "threads": 1,
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
        },
        "parameters": sum(t.numel() for t in init),
        "tensors": len(init),
        "shard": args.shard,
        "steps_per_round": args.steps,
        "repeats": args.repeats,
        "cpu_seconds_per_step": cpu,
        "cpu_seconds_per_step_median": median,
        "for_loop_over_fused": median["for-loop"] / median["fused"],
        "fused_vs_for_loop_max_rel_diff": diff,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print({k: round(v * 1000, 1) for k, v in median.items()}, "ms per step;", file=sys.stderr)


if __name__ == "__main__":
    main()
