"""The planner's FLOP count and memory against MosaicML's published MPT training table (llm-foundry).

llm-foundry's ``scripts/train/benchmarking/README.md`` (mosaicml/llm-foundry) publishes, for MPT models of 125M to
70B parameters trained with FSDP ``FULL_SHARD`` at 512 to 65,536 tokens per sequence, on 8 to 64 H100 80GB
(bf16) and A100 80GB GPUs (bf16; "1600 Gbps node-node interconnect (RoCE)"), each run's micro-batch, gradient
accumulation, global batch, activation checkpointing, tokens/s per GPU, parameter count, MFU and HFU (their
HFU counts the recomputed forward of a checkpointed block, as the planner does; not flash attention's own
recomputation). 52 H100 rows and 61 A100 rows, every row of those two tables.

Each row is planned as ``paratrain plan`` takes it: the GPT shape (``--model gpt3-175b --set model.dim=...
model.n_heads=... model.n_layers=... model.vocab_size=50368``: MPT's shape, a 4·dim MLP, learned positions, tied
embeddings; its parameter count equals the published one), ``--strategy zero3`` with ``--shard-accumulated-grads``
(Composer reduces the gradients of every micro-batch under FSDP), ``--grad-accum``, ``--activation-checkpointing
full`` where the run checkpointed, bf16, on the ``h100-nvlink-ib`` / ``a100-nvlink-ib`` presets. Three checks:

- **FLOPs**: at the row's published HFU as ``--efficiency``, the plan's tokens/s over the published one: the
  planner's FLOP count (recomputation, attention at long sequences, the output layer) against MosaicML's;
- **time at the calibrated default** (held out: no MosaicML row is in ``spec.hardware.EFFICIENCY``): MosaicML's
  tuned kernels (Triton flash attention, fused layers) run at HFU 0.31-0.59 on H100 and 0.42-0.79 on A100, so
  the tokens/s ratio at the default says how far a paratrain plan is from those runs;
- **memory**: every row ran, so a plan that says it does not fit is wrong for it; the plan's peak is compared
  with the preset's 80 GB (80e9 bytes).

    python benchmarks/bench_plan_mpt.py [--json benchmarks/results/plan_mpt.json]

Pure computation: no GPU, no process group.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

SOURCE = (
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md (MPT Training Benchmarks): tables 'H100 80GB BF16' "
    "and 'A100 80GB with 1600 Gbps node-node interconnect (RoCE)'"
)
SHAPES = {  # d_model, n_heads, n_layers (llm-foundry's mpt yamls; the counts match the published NumParams)
    "125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
    "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48), "70b": (8192, 64, 80),
}  # fmt: skip
# model, seq len, GPUs, HFU %, micro-batch, grad accum, global batch, tokens/s/GPU, activation checkpointing
H100 = """
70b 2048 64 56.76 8 4 2048 1039 1
70b 2048 32 48.2 2 16 1024 882 1
30b 8192 8 39.9 1 21 168 1384 1
30b 4096 8 47.81 1 21 168 1802 1
30b 2048 32 58.57 14 3 1344 2308 1
30b 2048 16 57.42 10 3 480 2263 1
30b 2048 8 50.82 3 21 504 2002 1
30b 1024 8 51.68 6 21 1008 2084 1
13b 32768 8 42.24 1 3 24 1976 1
13b 16384 8 47.4 3 3 72 2985 1
13b 4096 8 55.47 10 3 240 4717 1
13b 2048 64 39.86 2 1 128 4800 0
13b 2048 32 39.95 2 1 64 4811 0
13b 2048 16 39.58 2 1 32 4767 0
13b 2048 8 39.79 2 1 16 4792 0
13b 1024 8 59.03 40 3 960 5502 1
7b 65536 8 38.13 1 2 16 1956 1
7b 32768 8 41.25 2 2 32 3318 1
7b 8192 8 49.52 8 2 128 6935 1
7b 4096 8 53.9 16 2 256 8611 1
7b 2048 8 46.44 6 1 48 10643 0
7b 1024 8 57.11 64 2 1024 10203 1
3b 65536 8 35.74 1 2 16 3262 1
3b 32768 8 38.46 3 6 144 5873 1
3b 16384 8 36.34 1 6 48 11152 0
3b 8192 8 40.31 3 6 144 16578 0
3b 4096 8 42.31 5 6 240 20964 0
3b 2048 64 40.8 6 3 1152 22525 0
3b 2048 32 41.7 6 3 576 23021 0
3b 2048 16 43.73 10 3 480 24142 0
3b 1024 8 46.2 20 6 960 27046 0
3b 512 8 46.32 40 6 1920 27965 0
1b 65536 8 35.12 1 2 16 5506 1
1b 32768 8 33.54 1 4 32 12025 0
1b 16384 8 35.22 2 4 64 19649 0
1b 8192 8 37.73 3 4 96 29157 0
1b 4096 8 40.26 7 4 224 38535 0
1b 2048 64 40.85 20 1 1280 44402 0
1b 2048 32 41.52 20 1 640 45130 0
1b 2048 16 42.36 20 1 320 46037 0
1b 2048 8 41.82 14 1 112 45455 0
1b 1024 8 41.95 18 4 576 48910 0
1b 512 8 43.21 56 4 1792 52275 0
760m 32768 8 31.84 1 2 16 16291 0
760m 16384 8 33.57 3 2 48 27815 0
760m 8192 8 34.84 6 2 96 41825 0
760m 4096 8 35.83 12 2 192 55459 0
760m 2048 32 37.57 24 1 768 67971 0
760m 2048 16 37.89 24 1 384 68551 0
760m 2048 8 34.9 24 2 384 63147 0
760m 1024 8 39.76 48 2 768 78581 0
760m 512 8 40.42 96 2 1536 83749 0
"""
A100 = """
70b 2048 64 71.1 8 4 2048 410 1
70b 2048 32 64.75 2 16 1024 373 1
30b 8192 8 52.5 1 21 168 574 1
30b 4096 8 68.49 1 21 168 814 1
30b 2048 8 73.74 3 21 504 916 1
30b 1024 8 74.43 6 21 1008 946 1
30b 512 8 75.2 12 21 2016 967 1
13b 32768 8 68.92 1 3 24 1016 1
13b 16384 8 72.1 3 3 72 1431 1
13b 8192 8 74.76 5 3 120 1795 1
13b 4096 8 76.82 10 3 240 2060 1
13b 2048 8 59.57 2 3 48 2262 0
13b 1024 8 79.3 40 3 960 2330 1
7b 65536 8 62.63 1 2 16 1013 1
7b 32768 8 65.94 2 2 32 1672 1
7b 16384 8 69.28 4 2 64 2453 1
7b 8192 8 72.62 8 2 128 3206 1
7b 4096 8 73.12 16 2 256 3684 1
7b 2048 8 64.23 6 2 96 4641 0
7b 1024 8 77.35 64 2 1024 4357 1
3b 65536 8 61.41 1 2 16 1767 1
3b 32768 8 62.91 3 6 144 3029 1
3b 16384 8 57.13 1 6 48 5529 0
3b 8192 8 59.34 3 6 144 7695 0
3b 4096 8 60.53 5 6 240 9457 0
3b 2048 8 62.11 10 2 160 10811 0
3b 1024 8 62.73 20 6 960 11580 0
3b 512 8 63.71 40 6 1920 12127 0
1b 65536 8 61.57 1 2 16 3044 1
1b 32768 8 55.52 1 4 32 6275 0
1b 16384 8 56.6 2 4 64 9956 0
1b 8192 8 56.69 3 4 96 13814 0
1b 4096 8 59.0 7 4 224 17807 0
1b 2048 8 59.86 14 4 448 20513 0
1b 1024 8 60.15 18 4 576 22112 0
1b 512 8 60.68 56 4 1792 23148 0
760m 65536 8 60.45 1 2 16 4143 1
760m 32768 8 54.57 1 2 16 8802 0
760m 16384 8 54.64 3 2 48 14274 0
760m 8192 8 55.31 6 2 96 20933 0
760m 4096 8 56.05 12 2 192 27351 0
760m 2048 8 56.85 24 2 384 32434 0
760m 1024 8 47.76 48 2 768 29765 0
760m 512 8 45.07 96 2 1536 29446 0
350m 65536 8 52.7 1 2 16 7524 0
350m 32768 8 52.46 2 2 32 13652 0
350m 16384 8 53.28 4 2 64 23559 0
350m 8192 8 53.8 8 2 128 36569 0
350m 4096 8 53.31 16 2 256 49555 0
350m 2048 8 51.62 32 2 512 58782 0
350m 1024 8 50.51 64 2 1024 64813 0
350m 512 8 50.61 128 2 2048 69330 0
125m 65536 8 54.13 1 2 16 20368 0
125m 32768 8 52.71 2 2 32 36407 0
125m 16384 8 50.61 4 2 64 60040 0
125m 8192 8 48.85 8 2 128 90392 0
125m 4096 8 46.08 16 2 256 118396 0
125m 2048 8 44.79 40 2 640 142830 0
125m 2048 8 44.45 32 2 512 141737 0
125m 1024 8 43.15 64 2 1024 156468 0
125m 512 8 42.56 128 2 2048 165681 0
"""
TABLES = {"H100": (H100, "h100-nvlink-ib"), "A100": (A100, "a100-nvlink-ib")}


def _published() -> Any:
    path = Path(__file__).with_name("bench_plan_published.py")
    spec = importlib.util.spec_from_file_location("bench_plan_published", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows() -> list[dict[str, Any]]:
    """Every published row with the ``paratrain plan`` flags that express it."""
    out = []
    for gpu, (table, cluster) in TABLES.items():
        for line in table.strip().splitlines():
            model, seq, gpus, hfu, micro, accum, batch, tps, ac = line.split()
            d, h, layers = SHAPES[model]
            argv = ["--model", "gpt3-175b", "--set", f"model.dim={d}", f"model.n_heads={h}",
                    f"model.n_layers={layers}", "model.vocab_size=50368", "--cluster", cluster, "--gpus", gpus,
                    "--strategy", "zero3", "--shard-accumulated-grads", "--batch-size", batch, "--grad-accum", accum,
                    "--seq-len", seq, "--activation-checkpointing", "full" if ac == "1" else "none",
                    "--precision", "bf16"]  # fmt: skip
            out.append({"name": f"MPT-{model} seq {seq} on {gpus} {gpu} (micro-batch {micro}, accum {accum}"
                                f"{', AC' if ac == '1' else ''})", "gpu": gpu, "argv": argv,
                        "published": {"tokens_per_s_per_gpu": float(tps), "hfu": float(hfu) / 100,
                                      "micro_batch": int(micro)}})  # fmt: skip
    return out


def run() -> dict[str, Any]:
    bench = _published()
    out = []
    for row in rows():
        pub = row["published"]
        at_hfu, at_default = bench._plan(row["argv"], pub["hfu"], 0.0), bench._plan(row["argv"])
        assert at_hfu["micro_batch_size"] == pub["micro_batch"], row["name"]
        row["predicted"] = {
            "tokens_per_s_at_hfu": bench._tokens_per_gpu(at_hfu),
            "tokens_per_s_at_default": bench._tokens_per_gpu(at_default),
            "default_efficiency": at_default["efficiency"],
            "peak": at_default["bytes_per_rank"]["peak"],
            "fits": at_default["fits"],
        }
        row["flops_ratio"] = row["predicted"]["tokens_per_s_at_hfu"] / pub["tokens_per_s_per_gpu"]
        row["default_ratio"] = row["predicted"]["tokens_per_s_at_default"] / pub["tokens_per_s_per_gpu"]
        out.append(row)
    return {
        "benchmark": "bench_plan_mpt",
        "source": SOURCE,
        "conditions": {"host": platform.node(), "python": platform.python_version(),
                       "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg_start": os.getloadavg(),
                       "note": "pure computation; load does not change the figures"},
        "rows": out,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="benchmarks/results/plan_mpt.json")
    args = ap.parse_args()
    result = run()
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    for gpu in TABLES:
        rs = [r for r in result["rows"] if r["gpu"] == gpu]
        flops = [r["flops_ratio"] for r in rs]
        default = [r["default_ratio"] for r in rs]
        unfit = [r["name"] for r in rs if not r["predicted"]["fits"]]
        print(f"{gpu}: {len(rs)} rows; tokens/s at the published HFU / published {min(flops):.3f}-{max(flops):.3f}; "
              f"at the default efficiency {min(default):.2f}-{max(default):.2f}; planned not to fit: {len(unfit)}")  # fmt: skip
        for name in unfit:
            print(f"  does not fit in the plan: {name}")


if __name__ == "__main__":
    main()
