"""``--model hf:DIR`` against plain ``transformers``: training throughput, and loading a sharded checkpoint.

The model: a random Hugging Face ``LlamaForCausalLM`` of about 100 M parameters (hidden 768, 12 layers, 12
heads, MLP 2048, vocabulary 8192 from a byte-level BPE trained on this interpreter's standard library),
made by the benchmark and saved sharded (``max_shard_size=100MB``) with its tokenizer. fp32, CPU.

1. **Training, one process** (``train``): paratrain's ``Trainer.train_step`` of ``paratrain train --model
   hf:DIR --strategy single`` (its data, precision, scheduler, strategy step) against a plain loop:
   ``AutoModelForCausalLM.from_pretrained(DIR)``, ``torch.optim.AdamW``, next-token cross-entropy, on the
   same token batches (the trainer's packed sequences, batch ``--batch`` x ``--seq-len``), with the same
   AdamW settings (paratrain's defaults: weight decay 0). ``--rounds`` rounds of ``--steps`` steps each,
   alternating which runs first. Two figures: wall tokens/s per runner (median over rounds) with the
   median of the per-round ratios, and the **CPU time per step** (``time.process_time`` and
   ``time.thread_time`` around each step; one thread, so the process's CPU time is the step's work): on a
   machine shared with other jobs, wall time also counts the time the process waited for a core, CPU time
   does not. The CPU ratio is plain's median CPU seconds per step over paratrain's (above 1: paratrain does
   less work per step). Both runners' first losses are recorded (equal: same weights, same batch). Which model
   is allocated first in the process changes the figure by a few per cent (memory placement; a 12-layer
   probe: with paratrain's model built first its forward/backward took 4% more CPU than plain's, with
   plain's built first 1% less), so ``--build-first`` says which, and runs alternate it.
2. **Loading on 2 ranks** (``load``): ``paratrain.setup(build_model(hf:DIR), strategy="zero3")`` (meta
   build, FSDP2 sharding, each rank reads its slices) against ``from_pretrained(DIR)`` on every rank. Per
   rank: wall time and the growth of the process's peak resident memory (``ru_maxrss`` after minus before;
   the modules both import are imported before; every parameter is read once after loading, so weights that
   ``from_pretrained`` leaves memory-mapped count as resident too), in separate spawns. For paratrain also
   the growth during the read alone (after the meta model is sharded).

    python benchmarks/bench_hf.py            # both; writes benchmarks/results/hf.json
    python benchmarks/bench_hf.py --quick    # a 4-layer model, fewer steps (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def make_model_dir(d: Path, layers: int) -> dict[str, Any]:
    import sysconfig

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [
        p.read_text(errors="replace")
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:120]
    ]
    trainer = trainers.BpeTrainer(
        vocab_size=8192, special_tokens=["<pad>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    cfg = LlamaConfig(
        vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=12,
        num_key_value_heads=12, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(str(d), max_shard_size="100MB")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(str(d))
    corpus = d.parent / "corpus.txt"
    corpus.write_text("\n\n".join(texts))
    return {"num_params": sum(p.numel() for p in model.parameters()), "corpus": str(corpus)}


def bench_train(
    d: Path, corpus: str, batch: int, seq: int, steps: int, rounds: int, first: str = "paratrain",
    impl: str = "auto", reference_impl: str = "for-loop",
) -> dict[str, Any]:  # fmt: skip
    import torch
    from transformers import AutoModelForCausalLM

    from paratrain.config import RunConfig
    from paratrain.runtime import init
    from paratrain.train.worker import build_trainer

    cfg = RunConfig().override([
        f"model.name=hf:{d}", "data.name=text", f"data.path={corpus}", f"data.tokenizer=hf:{d}",
        f"data.seq_len={seq}", f"train.batch_size={batch}", f"train.steps={steps * rounds + 1}",
        "strategy.name=single", "optimizer.lr=1e-4", "checkpoint.save_at_end=false", "train.progress=false",
        f"optimizer.implementation={impl}",
    ])  # fmt: skip
    ctx = init(seed=cfg.train.seed)

    def load_plain() -> Any:
        return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="sdpa")

    plain = load_plain() if first == "plain" else None
    with tempfile.TemporaryDirectory() as run:
        trainer = build_trainer(cfg, ctx, Path(run))
    plain = plain if plain is not None else load_plain()
    from paratrain.data import DistributedBatchSampler

    data = trainer.data.train
    # the same batches in the same order: a second sampler with the trainer's seed
    sampler = DistributedBatchSampler(len(data), batch, 0, 1, seed=cfg.train.seed, shuffle=True)
    plain.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, betas=(0.9, 0.999), weight_decay=0.0,
                            fused=reference_impl == "fused")  # fmt: skip

    def plain_step() -> float:
        b = data.batch(sampler.next_batch())
        opt.zero_grad(set_to_none=True)
        logits = plain(input_ids=b.inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b.targets.flatten())
        loss.backward()
        opt.step()
        return float(loss)

    first_loss = {"paratrain": float(trainer.train_step()), "plain": plain_step()}  # warm-up step each
    step = {"paratrain": lambda: float(trainer.train_step()), "plain": plain_step}
    times: dict[str, list[float]] = {"paratrain": [], "plain": []}
    cpu: dict[str, list[float]] = {"paratrain": [], "plain": []}  # process CPU seconds, per step
    thread: dict[str, list[float]] = {"paratrain": [], "plain": []}  # the main thread's, per step
    for r in range(rounds):
        order = ["paratrain", "plain"] if r % 2 == 0 else ["plain", "paratrain"]
        for name in order:
            t0 = time.perf_counter()
            for _ in range(steps):
                c0, h0 = time.process_time(), time.thread_time()
                step[name]()  # float(): the step's work is done when it returns
                cpu[name].append(time.process_time() - c0)
                thread[name].append(time.thread_time() - h0)
            times[name].append(time.perf_counter() - t0)
    tokens = steps * batch * seq
    ratios = [p / q for p, q in zip(times["plain"], times["paratrain"], strict=True)]
    cpu_median = {k: statistics.median(v) for k, v in cpu.items()}
    return {
        "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
        "round_seconds": times,
        "paratrain_vs_plain_median_ratio": statistics.median(ratios),
        "ratio_range": [min(ratios), max(ratios)],
        "cpu_seconds_per_step": cpu,
        "thread_seconds_per_step": thread,
        "cpu_seconds_per_step_median": cpu_median,
        "cpu_tokens_per_s": {k: batch * seq / v for k, v in cpu_median.items()},
        "paratrain_vs_plain_cpu_ratio": cpu_median["plain"] / cpu_median["paratrain"],
        "first_loss": first_loss,
        "built_first": first,
        "optimizer_implementation": {"paratrain": trainer.optimizer_implementation, "plain": reference_impl},
        "batch": batch,
        "seq_len": seq,
        "steps_per_round": steps,
        "rounds": rounds,
    }


def _import_modeling() -> None:
    """The modules both loaders import, imported before the measured window."""
    import transformers.modeling_utils
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401


def _touch(model: Any) -> None:
    """Read every parameter once, so memory-mapped weights count as resident in both loaders."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).sum()


def _load_paratrain(d: str) -> dict[str, float]:
    import torch

    from paratrain.config import ModelConfig, StrategyConfig
    from paratrain.models import build_model
    from paratrain.parallel import build_strategy
    from paratrain.parallel.parallelize import materialize_deferred
    from paratrain.runtime import init

    _import_modeling()
    ctx = init(seed=None)
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731
    base = rss()
    t0 = time.perf_counter()
    model = build_model(ModelConfig(name=f"hf:{d}"), (1,), 1)  # meta
    strategy = build_strategy(ctx, StrategyConfig(name="zero3"))
    model, _ = strategy.wrap(model, None)  # FSDP2 over the meta model
    t_wrap, before_load = time.perf_counter() - t0, rss()
    materialize_deferred(model, torch.device("cpu"))  # allocate this rank's shards, read its slices
    seconds = time.perf_counter() - t0
    held = sum(p.to_local().numel() * 4 for p in model.parameters())  # type: ignore[operator]
    _touch(model)
    return {"seconds": seconds, "build_and_shard_seconds": t_wrap, "peak_growth_bytes": rss() - base,
            "peak_growth_during_read_bytes": rss() - before_load, "param_bytes_held": held}  # fmt: skip


def _load_from_pretrained(d: str) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    _import_modeling()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    seconds = time.perf_counter() - t0
    held = sum(p.numel() * 4 for p in model.parameters())
    _touch(model)
    return {"seconds": seconds, "peak_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024,
            "param_bytes_held": held}  # fmt: skip


def bench_load(d: Path, world: int) -> dict[str, Any]:
    from paratrain.testing import run_distributed

    out = {}
    for name, fn in (
        ("paratrain-zero3", _load_paratrain),
        ("from_pretrained-every-rank", _load_from_pretrained),
    ):
        out[name] = run_distributed(fn, world, args=(str(d),), timeout_s=900)
    return {"world_size": world, "per_rank": out}


def conditions(load_before: Any, **extra: Any) -> dict[str, Any]:
    """The host, versions and load of a run (both HF benchmarks store this); ``extra`` adds fields."""
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads_per_process": 1,
        "load_average_before": load_before,
        **extra,
        "load_average_after": os.getloadavg(),
    }


def add_optimizer_arguments(ap: argparse.ArgumentParser, reference: str) -> None:
    """``--paratrain-optimizer`` and ``--reference-optimizer``: each side's AdamW kernel (bench_hf_accelerate too)."""
    ap.add_argument("--paratrain-optimizer", choices=["auto", "for-loop", "fused"], default="auto",
                    help="paratrain's optimizer.implementation (auto: its default, torch's fused AdamW)")
    ap.add_argument("--reference-optimizer", choices=["for-loop", "fused"], default="for-loop",
                    help=f"{reference} AdamW: torch's CPU default (for-loop) or fused=True")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-load", action="store_true", help="training only (skip the loading benchmark)")
    ap.add_argument("--build-first", choices=["paratrain", "plain"], default="paratrain",
                    help="which model is allocated first in the process (memory placement changes a step's CPU "
                    "time by a few per cent; alternate it over runs)")  # fmt: skip
    add_optimizer_arguments(ap, "the plain loop's")
    ap.add_argument("--out", default=str(RESULTS / "hf.json"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()
    layers = 4 if args.quick else 12
    rounds = 2 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "llama-100m"
        made = make_model_dir(d, layers)
        print(f"model: {made['num_params'] / 1e6:.1f} M parameters in {d}", file=sys.stderr)
        train = bench_train(d, made["corpus"], args.batch, args.seq_len, args.steps, rounds, args.build_first,
                            args.paratrain_optimizer, args.reference_optimizer)  # fmt: skip
        print(json.dumps(train["tokens_per_s"]), train["paratrain_vs_plain_median_ratio"],
              train["paratrain_vs_plain_cpu_ratio"], file=sys.stderr)  # fmt: skip
        load_mid = os.getloadavg()
        load = None if args.no_load else bench_load(d, 2)
    result = {
        "benchmark": "bench_hf",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "conditions": conditions(load_before, load_average_after_train=load_mid),
        "model": {"arch": "LlamaForCausalLM", "layers": layers, "num_params": made["num_params"]},
        "train_single_process": train,
        "load": load,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
