"""``--model hf:DIR`` under ``zero3`` on 2 ranks against Accelerate with FSDP2, side by side in one run.

The model: bench_hf.py's random ``LlamaForCausalLM`` of about 100 M parameters (hidden 768, 12 layers, MLP
2048, vocabulary 8192), saved sharded with its tokenizer. fp32, CPU, Gloo, one thread per rank.

Both runners live in the same 2 processes and take the same batches in the same order:

- **paratrain**: the trainer of ``paratrain train --model hf:DIR --strategy zero3`` (``build_trainer``: its
  data, sampler, AdamW, constant schedule, FSDP2 over the decoder layers, the embedding, the head and the root,
  each rank reading its slices of the weights), one ``Trainer.train_step`` per step.
- **Accelerate**: the script an Accelerate user writes: ``AutoModelForCausalLM.from_pretrained(DIR)``,
  ``torch.optim.AdamW`` with the same settings, ``accelerator.prepare(model, optimizer)`` with a
  ``FullyShardedDataParallelPlugin(fsdp_version=2)`` wrapping each ``LlamaDecoderLayer`` (FULL_SHARD, reshard
  after forward), ``accelerator.backward(loss)``, ``optimizer.step()``; each rank's batch is the trainer's
  for that rank (a second sampler with the trainer's seed). Accelerate (1.15) enables FSDP for accelerator
  devices only; on a CPU its ``MULTI_CPU`` state is switched to ``FSDP`` with the plugin before ``prepare``,
  which then runs Accelerate's own FSDP2 preparation (``fsdp2_prepare_model``) unchanged.

One warm-up step each (first losses recorded), then ``--rounds`` rounds of ``--steps`` steps alternating
which runs first; a round is timed on rank 0 between barriers. Recorded: tokens/s per runner (median over
rounds), the per-round ratios, every step's loss (mean over the ranks) of both runners, which see the
same batches step for step, and each rank's **CPU time per step** (``time.process_time``, all the
process's threads, Gloo's included, and ``time.thread_time``, the training thread alone, around each
step). On a CPU shared with other jobs a rank's wall time also counts the waits for its peer to be given a
core at every collective; CPU time counts the work. The CPU ratio is Accelerate's median CPU seconds per
step over paratrain's, per rank (above 1: paratrain does less work per step).

    python benchmarks/bench_hf_accelerate.py            # writes benchmarks/results/hf_accelerate.json
    python benchmarks/bench_hf_accelerate.py --quick    # a 2-layer model, 2 rounds (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def _accelerate_model(d: str, lr: float, fused: bool) -> tuple[Any, Any, Any]:
    import torch
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType
    from transformers import AutoModelForCausalLM

    accelerator = Accelerator(cpu=True)  # joins the process group already up
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        reshard_after_forward=True,
        cpu_ram_efficient_loading=False,
    )
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0, fused=fused)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _race(
    d: str, run: str, corpus: str, batch: int, seq: int, steps: int, rounds: int, lr: float, impl: str,
    reference_impl: str,
) -> dict[str, Any]:  # fmt: skip
    import torch
    import torch.distributed as dist

    from paratrain.config import RunConfig
    from paratrain.data import DistributedBatchSampler
    from paratrain.runtime import init
    from paratrain.train.worker import build_trainer

    torch.set_num_threads(1)
    cfg = RunConfig().override([
        f"model.name=hf:{d}", "data.name=text", f"data.path={corpus}", f"data.tokenizer=hf:{d}",
        f"data.seq_len={seq}", f"train.batch_size={batch}", f"train.steps={steps * rounds + 1}",
        "strategy.name=zero3", f"optimizer.lr={lr}", "checkpoint.save_at_end=false", "train.progress=false",
        f"optimizer.implementation={impl}",
    ])  # fmt: skip
    ctx = init(seed=cfg.train.seed)
    trainer = build_trainer(cfg, ctx, Path(run))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = trainer.data.train
    sampler = DistributedBatchSampler(len(data), batch, rank, world, seed=cfg.train.seed, shuffle=True)
    accelerator, model, opt = _accelerate_model(d, lr, reference_impl == "fused")
    model.train()

    def accelerate_step() -> torch.Tensor:
        b = data.batch(sampler.next_batch())
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=b.inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b.targets.flatten())
        accelerator.backward(loss)
        opt.step()
        return loss.detach()

    run_step = {"paratrain": trainer.train_step, "accelerate": accelerate_step}
    losses: dict[str, list[torch.Tensor]] = {"paratrain": [], "accelerate": []}
    for name in ("paratrain", "accelerate"):  # warm-up
        losses[name].append(run_step[name]().detach().float().reshape(()))
    times: dict[str, list[float]] = {"paratrain": [], "accelerate": []}
    cpu: dict[str, list[float]] = {"paratrain": [], "accelerate": []}  # process CPU seconds per step
    thread: dict[str, list[float]] = {"paratrain": [], "accelerate": []}  # the training thread's
    for r in range(rounds):
        order = ["paratrain", "accelerate"] if r % 2 == 0 else ["accelerate", "paratrain"]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                c0, h0 = time.process_time(), time.thread_time()
                losses[name].append(run_step[name]().detach().float().reshape(()))
                cpu[name].append(time.process_time() - c0)
                thread[name].append(time.thread_time() - h0)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    mean = {}
    for name, ls in losses.items():
        t = torch.stack(ls)
        dist.all_reduce(t)
        mean[name] = (t / world).tolist()
    return {"round_seconds": times, "losses": mean, "num_params": trainer.num_params,
            "cpu_seconds_per_step": cpu, "thread_seconds_per_step": thread,
            "optimizer_implementation": {"paratrain": trainer.optimizer_implementation,
                                         "accelerate": reference_impl}}  # fmt: skip


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_hf import add_optimizer_arguments

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=4, help="global batch (2 per rank)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    add_optimizer_arguments(ap, "the Accelerate script's")
    ap.add_argument("--out", default=str(RESULTS / "hf_accelerate.json"))
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import accelerate
    from bench_hf import conditions, make_model_dir

    from paratrain.testing import run_distributed

    load_before = os.getloadavg()
    layers = 2 if args.quick else 12
    rounds = 2 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "llama-100m"
        made = make_model_dir(d, layers)
        print(f"model: {made['num_params'] / 1e6:.1f} M parameters in {d}", file=sys.stderr)
        per_rank = run_distributed(
            _race, 2, args=(str(d), str(Path(tmp) / "run"), made["corpus"], args.batch, args.seq_len, args.steps, rounds, args.lr,
                            args.paratrain_optimizer, args.reference_optimizer),
            timeout_s=3000,
        )  # fmt: skip
    got = per_rank[0]
    tokens = args.steps * args.batch * args.seq_len
    times = got["round_seconds"]
    ratios = [a / p for a, p in zip(times["accelerate"], times["paratrain"], strict=True)]
    lp, la = got["losses"]["paratrain"], got["losses"]["accelerate"]
    cpu = [{k: statistics.median(v) for k, v in r["cpu_seconds_per_step"].items()} for r in per_rank]
    result = {
        "benchmark": "bench_hf_accelerate",
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "conditions": conditions(
            load_before, accelerate=accelerate.__version__, world_size=2, backend="gloo"
        ),
        "model": {"arch": "LlamaForCausalLM", "layers": layers, "num_params": made["num_params"]},
        "global_batch": args.batch,
        "seq_len": args.seq_len,
        "steps_per_round": args.steps,
        "rounds": rounds,
        "tokens_per_s": {k: tokens / statistics.median(v) for k, v in times.items()},
        "round_seconds": times,
        "paratrain_vs_accelerate_ratios": ratios,
        "paratrain_vs_accelerate_median_ratio": statistics.median(ratios),
        "cpu_seconds_per_step_per_rank": [r["cpu_seconds_per_step"] for r in per_rank],
        "thread_seconds_per_step_per_rank": [r["thread_seconds_per_step"] for r in per_rank],
        "cpu_seconds_per_step_median_per_rank": cpu,
        "paratrain_vs_accelerate_cpu_ratio_per_rank": [c["accelerate"] / c["paratrain"] for c in cpu],
        "losses": got["losses"],
        "optimizer_implementation": got["optimizer_implementation"],
        "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(lp, la, strict=True)),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
