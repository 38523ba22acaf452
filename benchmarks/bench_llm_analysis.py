"""`paratrain plan` next to llm-analysis (issue 13) on GPT-3 175B and Llama 2 7B shapes.

llm-analysis (PyPI, 0.2.2) pins huggingface-hub<0.15 and transformers<5, which conflict with the
accelerate pin of the ``[bench]`` extra; its analysis does not need either (transformers is an optional
import, used only to fetch configs from the Hub). Install it without its dependencies:

    pip install --no-deps llm-analysis==0.2.2 "fire>=0.5,<0.6"
    python benchmarks/bench_llm_analysis.py [--quick] [--json benchmarks/results/llm_analysis.json]

Both tools get the same configuration: A100-SXM 80 GB (312 TFLOP/s bf16, efficiency 0.5), fp16/bf16
mixed precision with fp32 master weights and Adam (the ZeRO paper's 2+2+12 bytes: paratrain
``--precision fp16 --fp16-mixed --optimizer adamw``), the same tp/pp/dp, ZeRO stage, micro-batch,
global batch and sequence length, flash attention (paratrain ``--attention sdpa``), and no activation
recomputation. The model shapes are given to llm-analysis as JSON files with the
shapes of paratrain's presets where llm-analysis can express them. It cannot express Llama 2 7B's SwiGLU
(it asserts ffn_embed_dim % hidden_dim == 0, so 11008 is refused): like its own bundled
NousResearch_Llama-2-7b-hf config, it gets a 2-matrix MLP with ffn 16384 (134.2M parameters per layer
against SwiGLU's 135.3M). GPT-3: h 12288, 96 layers, 96 heads, ffn 4h.

paratrain reports two activation figures: ``activations`` (what its own Llama keeps, op by op:
``plan/implementation.py``; the peak uses it) and ``activations_korthikanti`` (Korthikanti et al.'s formula,
the figure llm-analysis also follows; the same number for GPT-3, which paratrain does not implement). Both are
recorded, and so is the like-with-like sum llm-analysis reports as its peak: model states + Korthikanti's
activations, everything at once (``sum_korthikanti``). paratrain's ``peak`` is instead the largest moment of the
step (``peak_moment``: ``plan/peak.py``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from paratrain.plan import cli as plan_cli

EFF = 0.5
CASES = [
    # name, paratrain model, llm-analysis shape, tp, pp, dp, zero stage, paratrain strategy, mbs, gbs, seq
    dict(
        name="llama2-7b zero3 dp8",
        model="llama2-7b",
        tp=1,
        pp=1,
        dp=8,
        zero=3,
        strategy="zero3",
        mbs=1,
        gbs=8,
        seq=4096,
    ),
    dict(
        name="llama2-7b zero1 dp8",
        model="llama2-7b",
        tp=1,
        pp=1,
        dp=8,
        zero=1,
        strategy="zero1",
        mbs=1,
        gbs=8,
        seq=4096,
    ),
    dict(
        name="llama2-7b tp8",
        model="llama2-7b",
        tp=8,
        pp=1,
        dp=1,
        zero=0,
        strategy="tp",
        mbs=1,
        gbs=1,
        seq=4096,
    ),
    dict(
        name="gpt3-175b tp8 pp8 (m=8)",
        model="gpt3-175b",
        tp=8,
        pp=8,
        dp=1,
        zero=0,
        strategy="tp+pp",
        mbs=1,
        gbs=8,
        seq=2048,
    ),
    # with tp/pp, paratrain's data-parallel axis is FSDP (ZeRO-3) only, so the pair is compared at stage 3
    dict(
        name="gpt3-175b tp8 pp8 zero3 dp2",
        model="gpt3-175b",
        tp=8,
        pp=8,
        dp=2,
        zero=3,
        strategy="fsdp+tp+pp",
        mbs=1,
        gbs=16,
        seq=2048,
    ),
]
SHAPES = {
    "llama2-7b": {
        "name": "llama2-7b",
        "num_layers": 32,
        "n_head": 32,
        "hidden_dim": 4096,
        "vocab_size": 32000,
        "max_seq_len": 4096,
        "num_key_value_heads": 32,
        "ffn_embed_dim": 16384,
        "model_type": "llama",
    },
    "gpt3-175b": {
        "name": "gpt3-175b",
        "num_layers": 96,
        "n_head": 96,
        "hidden_dim": 12288,
        "vocab_size": 50257,
        "max_seq_len": 2048,
        "ffn_embed_dim": 49152,
        "model_type": "gpt",
    },
}


def run_llm_analysis(case: dict, tmp: Path) -> dict:
    from llm_analysis.analysis import train

    shape_file = tmp / f"{case['model']}.json"
    shape_file.write_text(json.dumps(SHAPES[case["model"]]))
    return train(
        model_name=str(shape_file),
        gpu_name="a100-sxm-80gb",
        dtype_name="w16a16e16",
        log_level="ERROR",
        batch_size_per_gpu=case["mbs"],
        global_batch_size=case["gbs"],
        seq_len=case["seq"],
        ds_zero=case["zero"],
        tp_size=case["tp"],
        pp_size=case["pp"],
        dp_size=case["dp"],
        total_num_gpus=case["tp"] * case["pp"] * case["dp"],
        flops_efficiency=EFF,
        flash_attn=True,
        activation_recomputation=0,
        mlp_gated_linear_units=False,
        num_gpus_per_node=8,
        layernorm_dtype_bytes=2,
    )  # paratrain keeps norm inputs in the 2-byte compute dtype


def run_paratrain(case: dict) -> tuple[dict, int]:
    n = case["tp"] * case["pp"] * case["dp"]
    argv = [
        "--model",
        case["model"],
        "--gpus",
        str(n),
        "--gpus-per-node",
        "8",
        "--cluster",
        "a100-nvlink-ib",
        "--precision",
        "fp16",
        "--fp16-mixed",
        "--optimizer",
        "adamw",
        "--attention",
        "sdpa",
        "--efficiency",
        str(EFF),
        "--batch-size",
        str(case["gbs"]),
        "--seq-len",
        str(case["seq"]),
    ]
    if case["tp"] > 1:
        argv += ["--tp", str(case["tp"])]
    if case["pp"] > 1:
        argv += ["--pp", str(case["pp"]), "--microbatches", str(case["gbs"] // case["dp"] // case["mbs"])]
    if case["tp"] == 1 and case["pp"] == 1:
        argv += ["--strategy", case["strategy"]]
    elif case["zero"]:
        argv += ["--dp-shard", str(case["dp"])]
    parser = argparse.ArgumentParser(add_help=False)
    plan_cli.add_arguments(parser)
    res = plan_cli.build(parser.parse_args(argv))
    assert len(res["plans"]) == 1, [p["strategy"] for p in res["plans"]]
    return {"argv": argv, **res["plans"][0]}, int(res["num_params"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the first two cases only")
    ap.add_argument("--json", metavar="PATH", nargs="?", const="benchmarks/results/llm_analysis.json")
    args = ap.parse_args()
    try:
        import llm_analysis  # noqa: F401
    except ImportError:
        print("llm-analysis is not installed: pip install --no-deps llm-analysis==0.2.2 'fire>=0.5,<0.6'")
        return 1
    logging.getLogger("llm_analysis").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES[:2] if args.quick else CASES:
            la = run_llm_analysis(case, Path(tmp))
            pt, n_params = run_paratrain(case)
            b = pt["bytes_per_rank"]
            row = {
                "case": case,
                "params": {"paratrain": n_params, "llm_analysis": la["num_params_total"]},
                "weights": {"paratrain": b["params"], "llm_analysis": la["weight_memory_per_gpu"]},
                "grads": {"paratrain": b["grads"], "llm_analysis": la["gradient_memory_per_gpu"]},
                "optimizer": {
                    "paratrain": b["optimizer"],
                    "llm_analysis": la["optimizer_state_memory_per_gpu"],
                },
                "model_states": {
                    "paratrain": pt["model_state_bytes_per_rank"],
                    "llm_analysis": la["(weight+op_state+grad)_memory_per_gpu"],
                },
                "activations": {
                    "paratrain": b["activations"],
                    "llm_analysis": la["activation_memory_per_gpu"],
                },
                "activations_korthikanti": {
                    "paratrain": pt["activations_korthikanti"],
                    "llm_analysis": la["activation_memory_per_gpu"],
                },
                "sum_korthikanti": {  # everything at once, as llm-analysis's peak
                    "paratrain": pt["model_state_bytes_per_rank"] + pt["activations_korthikanti"],
                    "llm_analysis": la["(weight+op_state+grad+act)_memory_per_gpu"],
                },
                "peak": {
                    "paratrain": b["peak"],
                    "llm_analysis": la["(weight+op_state+grad+act)_memory_per_gpu"],
                },
                "peak_moment": pt["peak_moment"]["phase"],
                "step_time_s": {"paratrain": pt["time_s"]["step"], "llm_analysis": la["latency_per_iter"]},
                "compute_time_s": {
                    "paratrain": pt["time_s"]["compute"],
                    "llm_analysis": la["latency_per_iter"],
                },
                "bubble_s": {"paratrain": pt["time_s"]["bubble"], "llm_analysis": 0.0},
                "exposed_comm_s": {"paratrain": pt["time_s"]["exposed_comm"], "llm_analysis": 0.0},
                "paratrain_plan": pt,
                "llm_analysis_raw": {
                    k: v for k, v in la.items() if isinstance(v, (int, float, str, type(None)))
                },
            }
            rows.append(row)
    print(f"{'case':30s} {'figure':23s} {'paratrain':>14s} {'llm-analysis':>14s} {'pt/la':>7s}")
    for r in rows:
        for key in (
            "params",
            "weights",
            "grads",
            "optimizer",
            "model_states",
            "activations",
            "activations_korthikanti",
            "sum_korthikanti",
            "peak",
            "step_time_s",
            "compute_time_s",
            "bubble_s",
            "exposed_comm_s",
        ):
            p, q = r[key]["paratrain"], r[key]["llm_analysis"]
            ratio = p / q if q else (1.0 if p == q else float("inf"))
            fmt = (lambda x: f"{x:14.3f}") if key.endswith("_s") else (lambda x: f"{x / 1e9:12.2f} G")
            flag = "" if abs(ratio - 1) <= 0.05 else "  >5%"
            print(f"{r['case']['name']:30s} {key:23s} {fmt(p)} {fmt(q)} {ratio:7.3f}{flag}")
        print(f"{r['case']['name']:30s} paratrain's peak moment: {r['peak_moment']}")
        print()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"benchmark": "llm_analysis", "rows": rows}, indent=1, default=str)
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
