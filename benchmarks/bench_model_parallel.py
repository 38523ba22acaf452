"""Issue 11 benchmarks: single vs a plain loop, TP/PP communication, the pipeline bubble, memory per layout.

(a) tokens/s of ``paratrain train --strategy single`` (subprocess) against a plain hand-written loop that is
    the same computation (seeding, model, AdamW defaults, sampler order: the per-step losses are checked
    bit-identical). Interleaved pairs of processes, OMP_NUM_THREADS=1; the compared figure is steps 3..N
    (paratrain's step 2 runs under MemTracker), read from ``metrics.jsonl``. ``--part a-inproc`` alternates
    paratrain's ``Trainer.train_step`` and the plain step step by step in one process.
(b) ``--part b-tp`` / ``b-pp``: TP (with SP) collectives and PP send/recv bytes counted from the real ops.
(c) ``--part c``: the pipeline bubble of real ``--strategy pp --pp 2`` runs (gpipe, 1f1b; m = 1, 2, 4, 8)
    from per-op timelines, against (p-1)/(m+p-1); ``--reanalyse JSON --plot PNG`` redoes the analysis.
(d) ``--part d``: model-state and peak bytes per rank of 4-rank fsdp+tp and fsdp+pp against the plan.

Run every timing under the machine's benchmark lock: ``flock /tmp/paratrain-bench.lock python ...``.

    python benchmarks/bench_model_parallel.py [--quick] [--steps 20 --repeats 5] [--json [PATH]]
    python benchmarks/bench_model_parallel.py --part c --repeats 3 --steps 6 --dim 256 --layers 6 --seq 128 \
        --micro-batch 2 --json benchmarks/results/pp_bubble.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def plain_loop(
    model_name: str, steps: int, batch: int, seq: int, max_bytes: int, lr: float, seed: int
) -> dict:
    """A hand-written loop that does what ``paratrain train --strategy single`` does, and nothing else.

    Identical by construction: the seeding (python, numpy, torch), the order dataset-then-model, the model
    (``build_llama`` with the vocabulary of the byte tokenizer and ``max_seq_len`` at least ``seq``),
    ``AdamW(lr, betas=(0.9, 0.999), weight_decay=0)`` (paratrain's ``OptimizerConfig`` defaults), and the
    batches (paratrain's sampler order: ``randperm(N, generator=seed + epoch)``, contiguous blocks of B).
    So the per-step losses must equal paratrain's, which ``main`` checks.
    """
    import random

    import numpy as np
    import torch
    import torch.nn.functional as F

    from paratrain.config import DataConfig
    from paratrain.data import build_dataset
    from paratrain.models.llama import PRESETS, build_llama

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    data = build_dataset(DataConfig(name="python-stdlib", seq_len=seq, max_bytes=max_bytes))
    x_all, y_all = data.train.x, data.train.y
    model = build_llama(
        model_name,
        {"vocab_size": data.num_outputs, "max_seq_len": max(PRESETS[model_name].max_seq_len, seq)},
    )
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    model.train()
    n = x_all.shape[0]
    per_epoch = n // batch
    losses: list[torch.Tensor] = []
    t0 = time.perf_counter()
    marks = []
    for step in range(steps):
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        idx = perm[k * batch : (k + 1) * batch]
        x, y = x_all[idx], y_all[idx]
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        marks.append(time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    steady = (marks[-1] - marks[1]) / (steps - 2)  # steps 3..N, as for paratrain
    return {
        "tokens_per_s": steps * batch * seq / dt,
        "train_time_s": dt,
        "final_loss": float(loss.detach()),
        "losses": [float(v) for v in losses],
        "steady_s_per_step": steady,
        "steady_tokens_per_s": batch * seq / steady,
        "cumulative_s": marks,
        "num_params": sum(p.numel() for p in model.parameters()),
    }


def run_paratrain(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_mp_") as run_dir:
        cmd = [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            "--model",
            args.model,
            "--data",
            "python-stdlib",
            "--set",
            f"data.max_bytes={args.max_bytes}",
            "--seq-len",
            str(args.seq),
            "--strategy",
            "single",
            "--batch-size",
            str(args.batch),
            "--steps",
            str(args.steps),
            "--seed",
            str(args.seed),
            "--json",
            "--run-dir",
            run_dir,
            "--ckpt-every",
            "0",
            "--set",
            "train.log_every=1",
            "--set",
            f"optimizer.lr={args.lr}",
        ]
        p = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        if p.returncode:
            raise RuntimeError(p.stderr[-2000:])
        metrics = [json.loads(line) for f in Path(run_dir).rglob("metrics.jsonl") for line in f.open()]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    cum = {m["step"]: m["train_time_s"] for m in metrics if "train_time_s" in m and "step" in m}
    # step 2 runs under MemTracker (peak_bytes_per_rank) and is inside paratrain's train_time_s: the steady
    # window is steps 3..N, the same window as the plain loop's
    steady = (cum[args.steps] - cum[2]) / (args.steps - 2)
    return {
        "tokens_per_s": s["tokens_per_s"],
        "train_time_s": s["train_time_s"],
        "final_loss": s["final_loss"],
        "losses": s["losses"],
        "num_params": s["num_params"],
        "global_batch_size": s.get("global_batch_size"),
        "steady_s_per_step": steady,
        "steady_tokens_per_s": args.batch * args.seq / steady,
        "cumulative_s": [cum[k] for k in sorted(cum)],
    }


def run_plain(args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--_plain",
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
        "--max-bytes",
        str(args.max_bytes),
        "--seed",
        str(args.seed),
    ]
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=args.timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 pairs of llama-debug runs")
    ap.add_argument("--model", default="llama-small")
    ap.add_argument("--steps", type=int, default=6, help="≥ 4: steps 3..N are timed")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--max-bytes", type=int, default=200000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3, help="paratrain's OptimizerConfig.lr default")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", metavar="PATH", nargs="?", const="benchmarks/results/model_parallel.json")
    ap.add_argument("--_plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=["a", "a-inproc", "b-tp", "b-pp", "c", "d"], default="a")
    ap.add_argument("--dim", type=int, default=256, help="(c) model.dim of the llama-debug shape")
    ap.add_argument("--layers", type=int, default=6, help="(c) model.n_layers")
    ap.add_argument("--micro-batch", type=int, default=2, help="(c) samples per pipeline micro-batch")
    ap.add_argument("--reanalyse", metavar="JSON", help="(c) recompute the analysis of a stored result")
    ap.add_argument("--plot", metavar="PNG", help="(c) plot the bubble and two timelines")
    args = ap.parse_args()
    if args.part == "a-inproc":
        load0 = os.getloadavg()
        res = inproc_interleaved(args)
        m = res["median_s"]
        print(f"{args.model}, {args.steps} steps alternating, steps 3..N: train_step {m['paratrain']:.4f} s + loop extras "
              f"{m['paratrain_loop_extras'] * 1e3:.2f} ms, plain {m['plain']:.4f} s; tokens/s ratio paratrain/plain "
              f"{res['ratio_plain_over_paratrain_with_extras']:.3f} (per-step ratios: median {res['per_step_ratio_median']:.3f}, "
              f"quartiles {res['per_step_ratio_quartiles'][0]:.3f}..{res['per_step_ratio_quartiles'][2]:.3f}); "
              f"max |loss diff| {res['max_abs_loss_difference']:.2e}")  # fmt: skip
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            out: dict[str, Any] = {"benchmark": "model_parallel.a_inproc_interleaved", "config": vars(args), **res,
                   "load_avg": [load0, os.getloadavg()]}  # fmt: skip
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
            print(f"wrote {args.json}")
        return 0
    if args.part == "d":
        rows = memory_layouts(args)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            out = {
                "benchmark": "model_parallel.d_memory_4_ranks",
                "rows": rows,
                "load_avg": os.getloadavg(),
            }
            Path(args.json).write_text(json.dumps(out, indent=1))
            print(f"wrote {args.json}")
        return 0
    if args.part == "c":
        if args.reanalyse:
            res = json.loads(Path(args.reanalyse).read_text())
        else:
            res = json.loads(json.dumps(pp_bubble(args)))
        res["overlap_analysis"] = oa = overlap_analysis(res)
        print(f"solo f+b per micro-batch (gpipe m=1, the slower stage): {oa['solo_f_plus_b_s']:.4f} s")
        print("op slowdown when the other stage computes at the same time: "
              + ", ".join(f"{k} x{v:.2f}" for k, v in oa["overlap_slowdown"].items()))  # fmt: skip
        for key, w in oa["waits"].items():
            print(f"  {key}: hand-off median {w['handoff_median_s'] * 1e3:.2f} ms (max {w['handoff_max_s'] * 1e3:.1f}), "
                  f"schedule gaps {w['overhead_share_of_span_median']:.3f} of the span")  # fmt: skip
        if args.plot:
            plot_bubble(res, args.plot)
            print(f"wrote {args.plot}")
        for sp in oa["spans"]:
            print(f"  {sp['schedule']:5s} m={sp['m']}: span {sp['span_median_s']:.3f} s = "
                  f"{sp['span_over_ideal']:.2f} x (m+1)(f+b)_solo; bubble with solo busy {sp['bubble_if_solo_busy']:.3f}")  # fmt: skip
        print(f"\n{'schedule':8s} {'m':>2s} {'formula':>7s} {'stage0':>7s} {'stage1':>7s} {'pred0':>6s} {'pred1':>6s} "
              f"{'span s':>7s} {'ideal s':>7s} {'sim s':>6s}")  # fmt: skip
        for c in res["configs"]:
            st = {int(k): v for k, v in c["stages"].items()}
            pr = {int(k): v for k, v in c["bubble_predicted_from_stage_times"].items()}
            print(f"{c['schedule']:8s} {c['m']:>2d} {c['formula_bubble']:>7.3f} {st[0]['bubble_median']:>7.3f} "
                  f"{st[1]['bubble_median']:>7.3f} {pr[0]:>6.3f} {pr[1]:>6.3f} {c['span_median_s']:>7.3f} "
                  f"{c['span_ideal_balanced_s']:>7.3f} {c['span_predicted_from_stage_times_s']:>6.3f}")  # fmt: skip
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            out = {
                "benchmark": "model_parallel.c_pp_bubble",
                "config": vars(args),
                **res,
                "load_avg_end": os.getloadavg(),
            }
            Path(args.json).write_text(json.dumps(out, indent=1, default=str))
            print(f"wrote {args.json}")
        return 0
    if args.part == "b-pp":
        res = pp_comm(args.batch, args.seq, 4, 1, args.timeout)
        print(
            f"llama-debug pp=2, m=4, b={args.batch}, s={args.seq}, 1 step: s·b_micro·h = "
            f"{res['sbh_per_microbatch_bytes']:,} B; formula: {res['formula_send_bytes_per_rank_per_step']:,} B sent per rank"
        )
        for rank, r in res["per_rank"].items():
            print(
                f"{rank}: {r['sends_sbh_sized']} sends of s·b·h, {r['send_bytes_sbh_sized']:,} B; {r['all_ops']} ops in all; "
                f"others: {r['other_ops'][:6]}"
            )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(
                json.dumps(
                    {"benchmark": "model_parallel.b_pp_comm", **res, "load_avg": os.getloadavg()}, indent=1
                )
            )
            print(f"wrote {args.json}")
        return 0
    if args.part == "b-tp":
        res = tp_comm(args.batch, args.seq)
        print(f"llama-debug tp=2 SP, b={args.batch} s={args.seq}: s·b·h = {res['sbh_bytes']:,} B (fp32)")
        print(
            f"{'phase.collective':28s} {'count':>5s} {'of size s·b·h':>13s} {'full bytes':>12s} {'formula count':>13s}"
        )
        for k, c in sorted(res["counts"].items()):
            print(
                f"{k:28s} {c['count']:>5d} {c['count_sbh_sized']:>13d} {c['full_bytes']:>12,d} "
                f"{res['formula_sbh_collectives_per_layer_set'].get(k, '-'):>13}"
            )
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(
                json.dumps(
                    {"benchmark": "model_parallel.b_tp_comm", **res, "load_avg": os.getloadavg()}, indent=1
                )
            )
            print(f"wrote {args.json}")
        return 0
    if args._plain:
        print(
            json.dumps(
                plain_loop(args.model, args.steps, args.batch, args.seq, args.max_bytes, args.lr, args.seed)
            )
        )
        return 0
    if args.quick:
        args.model = "llama-debug" if args.model == "llama-small" else args.model
    runs: dict[str, list[dict]] = {"paratrain": [], "plain": []}
    loads = []
    pair_ratios: list[float] = []
    pair_ratios_median_step: list[float] = []
    pair_ratios_min_step: list[float] = []
    for i in range(args.repeats):
        loads.append(os.getloadavg())
        # alternate which side goes first, so that a drift in the machine's load does not favour one side
        order = ("paratrain", "plain") if i % 2 == 0 else ("plain", "paratrain")
        for side in order:
            runs[side].append(run_paratrain(args) if side == "paratrain" else run_plain(args))
        pt, pl = runs["paratrain"][-1], runs["plain"][-1]
        for r in (pt, pl):
            r["median_step_s"] = statistics.median(_steady_step_times(r["cumulative_s"]))
            r["min_step_s"] = min(_steady_step_times(r["cumulative_s"]))  # load only adds time
        pair_ratios.append(pt["steady_tokens_per_s"] / pl["steady_tokens_per_s"])
        pair_ratios_median_step.append(pl["median_step_s"] / pt["median_step_s"])
        pair_ratios_min_step.append(pl["min_step_s"] / pt["min_step_s"])
        print(
            f"pair {i} ({order[0]} first): steps 3..N: paratrain {pt['steady_tokens_per_s']:.0f} tok/s "
            f"({pt['steady_s_per_step']:.3f} s/step, median step {pt['median_step_s']:.3f}), plain "
            f"{pl['steady_tokens_per_s']:.0f} ({pl['steady_s_per_step']:.3f}, median {pl['median_step_s']:.3f}); "
            f"ratio {pair_ratios[-1]:.3f}, median-step ratio {pair_ratios_median_step[-1]:.3f}, fastest-step ratio "
            f"{pair_ratios_min_step[-1]:.3f}; "
            f"load {loads[-1][0]:.2f}  (loss paratrain {pt['final_loss']:.6f}, plain {pl['final_loss']:.6f})",
            flush=True,
        )
    assert runs["paratrain"][0]["num_params"] == runs["plain"][0]["num_params"]
    # the two loops must be the same computation: the same per-step losses
    loss_diff = max(
        abs(a - b)
        for pt, pl in zip(runs["paratrain"], runs["plain"], strict=True)
        for a, b in zip(pt["losses"], pl["losses"], strict=True)
    )
    med_all = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    med = {k: statistics.median(r["steady_tokens_per_s"] for r in v) for k, v in runs.items()}
    ratio = med["paratrain"] / med["plain"]
    print(f"max |loss difference| over every step of every pair: {loss_diff:.2e}")
    print(
        f"all steps (incl. warm-up and paratrain's MemTracker step 2): paratrain {med_all['paratrain']:.0f}, "
        f"plain {med_all['plain']:.0f}, ratio {med_all['paratrain'] / med_all['plain']:.3f}"
    )
    print(
        f"per-pair ratios (steps 3..N mean): median {statistics.median(pair_ratios):.3f}, "
        f"range {min(pair_ratios):.3f}..{max(pair_ratios):.3f}; of median step times: median "
        f"{statistics.median(pair_ratios_median_step):.3f}, range "
        f"{min(pair_ratios_median_step):.3f}..{max(pair_ratios_median_step):.3f}; of fastest steps: median "
        f"{statistics.median(pair_ratios_min_step):.3f}, range {min(pair_ratios_min_step):.3f}.."
        f"{max(pair_ratios_min_step):.3f}"
    )
    print(
        f"\n{'model':12s} {'steps':>5s} {'b':>3s} {'s':>4s} {'paratrain tok/s':>16s} {'plain tok/s':>12s} "
        f"{'ratio':>6s}  target ±3%"
    )
    print(
        f"{args.model:12s} {args.steps:>5d} {args.batch:>3d} {args.seq:>4d} {med['paratrain']:>16.0f} "
        f"{med['plain']:>12.0f} {ratio:>6.3f}  {'ok' if abs(ratio - 1) <= 0.03 else 'MISS'}"
    )
    if args.json:
        out = {
            "benchmark": "model_parallel.a_single_vs_plain",
            "config": vars(args),
            "runs": runs,
            "max_abs_loss_difference": loss_diff,
            "median_steady_tokens_per_s": med,
            "ratio_steady": ratio,
            "pair_ratios_steady": pair_ratios,
            "pair_ratios_median_step": pair_ratios_median_step,
            "pair_ratios_min_step": pair_ratios_min_step,
            "median_all_steps_tokens_per_s": med_all,
            "ratio_all_steps": med_all["paratrain"] / med_all["plain"],
            "load_avg": loads,
            "load_avg_end": os.getloadavg(),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


def inproc_interleaved(args: argparse.Namespace) -> dict:
    """Part (a), step-interleaved in one process: paratrain's ``Trainer.train_step`` plus the loop's per-step
    work (``flush_losses``, ``observers.on_step_end`` with ``log_every=1``, ``lifecycle.after_step``)
    against the plain step, alternating step by step, so that both see the same machine at the same
    moment. Two models from the same seed, two optimizers; the losses are checked equal."""
    import random

    import numpy as np
    import torch
    import torch.nn.functional as F

    from paratrain.config import RunConfig
    from paratrain.runtime import init
    from paratrain.train.worker import build_trainer

    torch.set_num_threads(1)
    cfg = RunConfig.from_dict({
        "model": {"name": args.model},
        "data": {"name": "python-stdlib", "seq_len": args.seq, "max_bytes": args.max_bytes},
        "strategy": {"name": "single"},
        "optimizer": {"lr": args.lr},
        "train": {"batch_size": args.batch, "steps": args.steps, "seed": args.seed, "log_every": 1},
        "checkpoint": {"every": 0},
    })  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_inproc_") as run_dir:
        ctx = init(cfg.launch.backend, cfg.launch.device, cfg.launch.timeout_s, cfg.train.seed)
        tr = build_trainer(cfg, ctx, Path(run_dir))
        # the plain side: the same seed and build order as the worker (init seeds, then data, then model)
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        from paratrain.models import build_model

        model = build_model(cfg.model, tr.data.input_shape, tr.data.num_outputs)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.999), weight_decay=0.0)
        x_all, y_all = tr.data.train.x, tr.data.train.y
        n, per_epoch = x_all.shape[0], x_all.shape[0] // args.batch
        tr.observers.begin(0, args.steps)
        times: dict[str, list[float]] = {"paratrain": [], "paratrain_loop_extras": [], "plain": []}
        losses: dict[str, list[float]] = {"paratrain": [], "plain": []}
        clock = 0.0
        for step in range(args.steps):
            t0 = time.perf_counter()
            loss = tr.train_step()
            t1 = time.perf_counter()
            tr.state.pending.append(loss)
            tr.state.step += 1
            tr.flush_losses()
            clock += t1 - t0
            tr.observers.on_step_end(tr.state.step, {"step": tr.state.step, "loss": tr.state.losses[-1],
                                     "lr": tr.state.scheduler.get_last_lr()[0], "train_time_s": clock})  # fmt: skip
            tr.lifecycle.after_step()
            tr.observers.after_step(tr.state.step)
            t2 = time.perf_counter()
            epoch, k = divmod(step, per_epoch)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))
            idx = perm[k * args.batch : (k + 1) * args.batch]
            x, y = x_all[idx], y_all[idx]
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            ploss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            ploss.backward()
            opt.step()
            t3 = time.perf_counter()
            times["paratrain"].append(t1 - t0)
            times["paratrain_loop_extras"].append(t2 - t1)
            times["plain"].append(t3 - t2)
            losses["paratrain"].append(tr.state.losses[-1])
            losses["plain"].append(float(ploss.detach()))
    steady = {k: v[2:] for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in steady.items()}
    per_step_ratio = [
        pl / (pt + ex)
        for pt, ex, pl in zip(
            steady["paratrain"], steady["paratrain_loop_extras"], steady["plain"], strict=True
        )
    ]
    return {
        "times_s": times,
        "losses": losses,
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(*losses.values(), strict=True)),
        "median_s": med,
        "ratio_plain_over_paratrain_with_extras": med["plain"]
        / (med["paratrain"] + med["paratrain_loop_extras"]),
        "ratio_plain_over_train_step": med["plain"] / med["paratrain"],
        "per_step_ratio_median": statistics.median(per_step_ratio),
        "per_step_ratio_quartiles": statistics.quantiles(per_step_ratio, n=4),
    }


def _steady_step_times(cumulative: list[float]) -> list[float]:
    """Durations of steps 3..N from the cumulative clock after each step (index k-1 holds step k)."""
    return [cumulative[i] - cumulative[i - 1] for i in range(2, len(cumulative))]


# ---- (b) TP communication volume, counted from the real collectives ------------------------------------
def _tp_worker(rank: int, world: int, port: int, batch: int, seq: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.utils._python_dispatch import TorchDispatchMode

    from paratrain.models.llama import build_llama
    from paratrain.models.llama_parallel import tp_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = build_llama("llama-debug")
    parallelize_module(model, mesh, dict(tp_plan(model, sequence_parallel=True, loss_parallel=False)))
    x = torch.randint(0, 256, (batch, seq))
    y = torch.randint(0, 256, (batch, seq))
    c10d = torch.ops._c10d_functional

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.records: list[dict] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            packet = func._overloadpacket
            full = None
            if packet is c10d.all_gather_into_tensor:
                full, kind = args[0].numel() * args[1] * args[0].element_size(), "all_gather"
            elif packet is c10d.reduce_scatter_tensor:
                full, kind = args[0].numel() * args[0].element_size(), "reduce_scatter"
            elif packet is c10d.all_reduce:
                full, kind = args[0].numel() * args[0].element_size(), "all_reduce"
            elif packet is c10d.all_to_all_single:
                full, kind = args[0].numel() * args[0].element_size(), "all_to_all"
            if full is not None:
                self.records.append(
                    {"phase": self.phase, "op": kind, "full_bytes": full, "shape": list(args[0].shape)}
                )
            return func(*args, **kwargs)

    mode = Count()
    with mode:
        logits = model(x)
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        mode.phase = "backward"
        loss.backward()
    if rank == 0:
        Path(out).write_text(json.dumps(mode.records))
    dist.destroy_process_group()


def tp_comm(batch: int, seq: int) -> dict:
    import torch.multiprocessing as mp

    from paratrain.models.llama import PRESETS

    cfg = PRESETS["llama-debug"]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "records.json")
        port = 29500 + os.getpid() % 1000
        mp.spawn(_tp_worker, args=(2, port, batch, seq, out), nprocs=2, join=True)
        records = json.loads(Path(out).read_text())
    sbh = seq * batch * cfg.dim * 4  # fp32
    counts: dict[str, dict] = {}
    for r in records:
        key = f"{r['phase']}.{r['op']}"
        c = counts.setdefault(key, {"count": 0, "full_bytes": 0, "of_sbh": 0})
        c["count"] += 1
        c["full_bytes"] += r["full_bytes"]
        c["count_sbh_sized"] = c.get("count_sbh_sized", 0) + (r["full_bytes"] == sbh)
    L = cfg.n_layers
    formula = {
        "forward.all_gather": 2 * L,
        "forward.reduce_scatter": 2 * L,
        "backward.all_gather": 2 * L,
        "backward.reduce_scatter": 2 * L,
    }
    return {
        "sbh_bytes": sbh,
        "layers": L,
        "records": records,
        "counts": counts,
        "formula_sbh_collectives_per_layer_set": formula,
    }


# ---- (b) PP communication volume, counted from the real point-to-point ops --------------------------------
_SITECUSTOMIZE = """
import json, os
if os.environ.get("PT_P2P_OUT"):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    _state = {"in_batch": False}

    def _log(kind, t, via):
        path = os.path.join(os.environ["PT_P2P_OUT"], "rank%s.jsonl" % os.environ.get("RANK", "x"))
        with open(path, "a") as f:
            f.write(json.dumps([kind, t.numel() * t.element_size(), list(t.shape), via]) + "\\n")

    def _wrap(name):
        orig = getattr(dist, name)

        def w(tensor, *a, **k):
            if not _state["in_batch"]:
                _log(name, tensor, "direct")
            return orig(tensor, *a, **k)
        w.__name__ = name
        setattr(dist, name, w)
        setattr(c10d, name, w)  # P2POp checks its op against c10d's own names

    for _n in ("isend", "irecv", "send", "recv"):
        _wrap(_n)
    _orig_batch = dist.batch_isend_irecv

    def _batch(ops):
        for o in ops:
            _log(getattr(o.op, "__name__", str(o.op)), o.tensor, "batch")
        _state["in_batch"] = True
        try:
            return _orig_batch(ops)
        finally:
            _state["in_batch"] = False
    dist.batch_isend_irecv = _batch
"""


def pp_comm(batch: int, seq: int, microbatches: int, steps: int, timeout: float) -> dict:
    from paratrain.models.llama import PRESETS

    cfg = PRESETS["llama-debug"]
    with tempfile.TemporaryDirectory(prefix="bench_pp_") as tmp:
        site, out = Path(tmp) / "site", Path(tmp) / "p2p"
        site.mkdir()
        out.mkdir()
        (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        cmd = [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            "--model",
            "llama-debug",
            "--data",
            "python-stdlib",
            "--set",
            "data.max_bytes=200000",
            "--seq-len",
            str(seq),
            "--strategy",
            "pp",
            "--pp",
            "2",
            "--microbatches",
            str(microbatches),
            "--batch-size",
            str(batch),
            "--nproc-per-node",
            "2",
            "--steps",
            str(steps),
            "--json",
            "--run-dir",
            str(Path(tmp) / "run"),
            "--ckpt-every",
            "0",
        ]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PT_P2P_OUT": str(out),
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        }
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if p.returncode:
            raise RuntimeError(p.stderr[-2000:])
        per_rank = {f.stem: [json.loads(line) for line in f.open()] for f in sorted(out.glob("*.jsonl"))}
    mb = batch // microbatches
    sbh_mb = seq * mb * cfg.dim * 4
    summary = {}
    for rank, recs in per_rank.items():
        sends = [r for r in recs if r[0] in ("isend", "send") and r[1] == sbh_mb]
        summary[rank] = {
            "send_bytes_sbh_sized": sum(r[1] for r in sends),
            "sends_sbh_sized": len(sends),
            "all_ops": len(recs),
            "other_ops": [r for r in recs if r[1] != sbh_mb][:20],
        }
    return {
        "sbh_per_microbatch_bytes": sbh_mb,
        "microbatches": microbatches,
        "steps": steps,
        "formula_send_bytes_per_rank_per_step": sbh_mb * microbatches,
        "per_rank": summary,
        "raw": per_rank,
    }


# ---- (c) the pipeline bubble, measured on paratrain's pp strategy -----------------------------------------
# A sitecustomize on the workers' PYTHONPATH times, with the system-wide monotonic clock (one clock for both
# processes on one machine), every compute op of the schedule: PipelineStage.forward_one_chunk, the last
# stage's loss (_maybe_compute_loss) and backward_one_chunk, plus the span of each schedule.step(). Nothing in
# paratrain is changed; the waits (p2p receives, the schedule's own Python) are what is left of the span.
_BUBBLE_SITE = """
import json, os, time
if os.environ.get("PT_BUBBLE_OUT"):
    from torch.distributed.pipelining import schedules as _sch, stage as _stg
    _clock = time.monotonic
    _path = os.path.join(os.environ["PT_BUBBLE_OUT"], "rank%s.jsonl" % os.environ.get("RANK", "x"))
    _state = {"step": 0}

    def _log(kind, mb, t0, t1):
        with open(_path, "a") as f:
            f.write(json.dumps([_state["step"], kind, mb, t0, t1]) + "\\n")

    def _timed(cls, name, kind):
        orig = getattr(cls, name)

        def w(self, *a, **k):
            t0 = _clock()
            try:
                return orig(self, *a, **k)
            finally:
                _log(kind, a[0] if a and isinstance(a[0], int) else k.get("bwd_chunk_id", -1), t0, _clock())
        setattr(cls, name, w)

    _timed(_stg._PipelineStageBase, "forward_one_chunk", "F")
    _timed(_stg._PipelineStageBase, "backward_one_chunk", "B")
    _orig_loss = _sch._PipelineSchedule._maybe_compute_loss

    def _loss(self, stage, output, target_mbs, mb_index, *a, **k):
        t0 = _clock()
        try:
            return _orig_loss(self, stage, output, target_mbs, mb_index, *a, **k)
        finally:
            if stage.is_last:
                _log("L", mb_index, t0, _clock())
    _sch._PipelineSchedule._maybe_compute_loss = _loss
    _orig_step = _sch.PipelineScheduleSingle.step

    def _step(self, *a, **k):
        _state["step"] += 1
        t0 = _clock()
        try:
            return _orig_step(self, *a, **k)
        finally:
            _log("step", -1, t0, _clock())
    _sch.PipelineScheduleSingle.step = _step
"""


def pp_bubble_run(
    schedule: str, m: int, micro_batch: int, seq: int, dim: int, layers: int, steps: int, timeout: float
) -> dict:
    """One ``paratrain train --strategy pp --pp 2`` run; the per-step compute events of each rank."""
    with tempfile.TemporaryDirectory(prefix="bench_bubble_") as tmp:
        site, out = Path(tmp) / "site", Path(tmp) / "ev"
        site.mkdir()
        out.mkdir()
        (site / "sitecustomize.py").write_text(_BUBBLE_SITE)
        sets = {
            "data.max_bytes": 400000,
            "model.dim": dim,
            "model.ffn_hidden": 3 * dim,
            "model.n_layers": layers,
            "train.log_every": 1000,
        }
        cmd = [sys.executable, "-m", "paratrain", "train", "--model", "llama-debug", "--data", "python-stdlib",
               "--seq-len", str(seq), "--strategy", "pp", "--pp", "2", "--pp-schedule", schedule,
               "--microbatches", str(m), "--batch-size", str(m * micro_batch), "--nproc-per-node", "2",
               "--steps", str(steps), "--json", "--run-dir", str(Path(tmp) / "run"), "--ckpt-every", "0"]  # fmt: skip
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PT_BUBBLE_OUT": str(out),
            "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        }
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if p.returncode:
            raise RuntimeError(p.stderr[-3000:])
        events = {int(f.stem[4:]): [json.loads(x) for x in f.open()] for f in sorted(out.glob("rank*.jsonl"))}
    return {
        "schedule": schedule,
        "m": m,
        "events": events,
        "final_loss": json.loads(p.stdout.splitlines()[-1])["final_loss"],
    }


def bubble_of_step(events: dict[int, list], step: int) -> dict:
    """The bubble of one schedule step from both ranks' compute events.

    ``span``: from the first compute op's start on any stage to the last one's end (the pipeline's
    makespan, without the schedule's set-up before the first op and the gradient/loss handling after it).
    Per stage: ``busy`` = the sum of its ops (forward, loss, backward), ``bubble = 1 - busy / span``. The
    ``step_wall`` figures are each rank's whole ``schedule.step()`` for comparison.
    """
    ops = {r: [e for e in ev if e[0] == step and e[1] in ("F", "B", "L")] for r, ev in events.items()}
    t0 = min(e[3] for ev in ops.values() for e in ev)
    t1 = max(e[4] for ev in ops.values() for e in ev)
    span = t1 - t0
    out: dict = {"span_s": span, "stages": {}}
    for r, ev in ops.items():
        busy = {k: sum(e[4] - e[3] for e in ev if e[1] == k) for k in ("F", "L", "B")}
        wall = [e[4] - e[3] for e in events[r] if e[0] == step and e[1] == "step"]
        out["stages"][r] = {
            "busy_s": sum(busy.values()),
            "forward_s": busy["F"],
            "loss_s": busy["L"],
            "backward_s": busy["B"],
            "bubble": 1 - sum(busy.values()) / span,
            "step_wall_s": wall[0] if wall else None,
            "bubble_vs_step_wall": 1 - sum(busy.values()) / wall[0] if wall else None,
            "ops": [[e[1], e[2], e[3] - t0, e[4] - t0] for e in ev],
        }
    return out


def predicted_span(schedule: str, m: int, f: list[float], b: list[float]) -> float:
    """Makespan of 2 stages with per-micro-batch forward ``f[i]`` (incl. loss) and backward ``b[i]``, zero
    communication cost: a dependency simulation of the schedule's op order on each stage."""
    p = len(f)
    order = {r: _op_order(schedule, m, p, r) for r in range(p)}
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    pos = [0] * p
    while any(pos[r] < len(order[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] >= len(order[r]):
                continue
            kind, i = order[r][pos[r]]
            if kind == "F":
                dep = done.get(("F", r - 1, i)) if r > 0 else 0.0
            else:
                dep = done.get(("B", r + 1, i)) if r < p - 1 else done.get(("F", r, i))
            if dep is None:
                continue
            start = max(clock[r], dep)
            clock[r] = start + (f[r] if kind == "F" else b[r])
            done[(kind, r, i)] = clock[r]
            pos[r] += 1
            progressed = True
        assert progressed, "schedule deadlock"
    return max(clock)


def _op_order(schedule: str, m: int, p: int, r: int) -> list[tuple[str, int]]:
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(m, p - 1 - r)  # 1F1B: p-1-r warm-up forwards, then alternate, then drain the backwards
    ops = [("F", i) for i in range(warm)]
    fi, bi = warm, 0
    while fi < m:
        ops += [("F", fi), ("B", bi)]
        fi, bi = fi + 1, bi + 1
    ops += [("B", i) for i in range(bi, m)]
    return ops


def pp_bubble(args: argparse.Namespace) -> dict:
    configs = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 2, 4, 8) if not (s == "1f1b" and m < 2)]
    raw: list[dict] = []
    loads = []
    for rep in range(args.repeats):
        for schedule, m in configs if rep % 2 == 0 else list(reversed(configs)):
            loads.append(os.getloadavg())
            run = pp_bubble_run(
                schedule, m, args.micro_batch, args.seq, args.dim, args.layers, args.steps, args.timeout
            )
            run["repeat"] = rep
            run["load_avg"] = loads[-1]
            run["per_step"] = {st: bubble_of_step(run["events"], st) for st in range(3, args.steps + 1)}
            del run["events"]
            raw.append(run)
            b = [
                statistics.median(v["stages"][r]["bubble"] for v in run["per_step"].values()) for r in (0, 1)
            ]
            print(f"rep {rep} {schedule:5s} m={m}: span {statistics.median(v['span_s'] for v in run['per_step'].values()):.3f} s, "
                  f"bubble stage0 {b[0]:.3f} stage1 {b[1]:.3f} (formula {1 / (m + 1):.3f}); load {loads[-1][0]:.2f}", flush=True)  # fmt: skip
    table = []
    for schedule, m in configs:
        steps = [v for r in raw if (r["schedule"], r["m"]) == (schedule, m) for v in r["per_step"].values()]
        per_stage = {}
        for st in (0, 1):
            bub = [v["stages"][st]["bubble"] for v in steps]
            per_stage[st] = {
                "bubble_median": statistics.median(bub),
                "bubble_min": min(bub),
                "bubble_max": max(bub),
                "bubble_vs_step_wall_median": statistics.median(v["stages"][st]["bubble_vs_step_wall"] for v in steps),
                "f_per_mb_s": statistics.median((v["stages"][st]["forward_s"] + v["stages"][st]["loss_s"]) / m for v in steps),
                "b_per_mb_s": statistics.median(v["stages"][st]["backward_s"] / m for v in steps),
            }  # fmt: skip
        f = [per_stage[st]["f_per_mb_s"] for st in (0, 1)]
        b = [per_stage[st]["b_per_mb_s"] for st in (0, 1)]
        span_pred = predicted_span(schedule, m, f, b)
        span = statistics.median(v["span_s"] for v in steps)
        table.append({
            "schedule": schedule, "m": m, "p": 2, "n_steps": len(steps),
            "formula_bubble": 1 / (m + 1),
            "span_median_s": span, "span_min_s": min(v["span_s"] for v in steps), "span_max_s": max(v["span_s"] for v in steps),
            "span_ideal_balanced_s": (m + 1) * max(f[i] + b[i] for i in (0, 1)),
            "span_predicted_from_stage_times_s": span_pred,
            "bubble_predicted_from_stage_times": {st: 1 - m * (f[st] + b[st]) / span_pred for st in (0, 1)},
            "stages": per_stage,
        })  # fmt: skip
    workload = {
        "model": f"llama-debug with --set model.dim={args.dim} model.ffn_hidden={3 * args.dim} "
        f"model.n_layers={args.layers}",
        "strategy": "pp",
        "pp": 2,
        "seq_len": args.seq,
        "micro_batch": args.micro_batch,
        "batch_size": "m * micro_batch",
        "timed_steps": f"3..{args.steps} of each run",
        "runs_per_config": args.repeats,
    }
    return {"workload": workload, "configs": table, "runs": raw, "load_avg": loads}


def overlap_analysis(res: dict) -> dict:
    """``res``: part (c)'s result as stored in JSON (stage keys are strings).

    Why the bubble is not the formula's on this machine: each compute op's duration against how much of
    it overlapped an op of the other stage (the two stage processes share 2 vCPUs of a VM), and the span
    of each configuration against ``(m + p - 1) * (f + b)`` with the *solo* per-micro-batch times of the
    m = 1 GPipe run, in which no two ops overlap."""
    durations: dict[tuple[int, str, str], list[float]] = {}
    for run in res["runs"]:
        for step in run["per_step"].values():
            st = step["stages"]
            for r, other in ((0, 1), (1, 0)):
                theirs = [(o[2], o[3]) for o in st[str(other)]["ops"] if o[0] in ("F", "B")]
                for kind, _mb, a, b in st[str(r)]["ops"]:
                    if kind not in ("F", "B") or b <= a:
                        continue
                    ov = sum(max(0.0, min(b, y) - max(a, x)) for x, y in theirs) / (b - a)
                    cls = "solo" if ov < 0.1 else "overlapped" if ov > 0.9 else "partial"
                    durations.setdefault((r, kind, cls), []).append(b - a)
    ops = {
        f"stage{r}.{kind}.{cls}": {"n": len(v), "median_s": statistics.median(v)}
        for (r, kind, cls), v in sorted(durations.items())
    }
    slowdown = {}
    for r in (0, 1):
        for kind in ("F", "B"):
            solo, both = ops.get(f"stage{r}.{kind}.solo"), ops.get(f"stage{r}.{kind}.overlapped")
            if solo and both:
                slowdown[f"stage{r}.{kind}"] = both["median_s"] / solo["median_s"]
    base = next(c for c in res["configs"] if (c["schedule"], c["m"]) == ("gpipe", 1))
    fb = max(v["f_per_mb_s"] + v["b_per_mb_s"] for v in base["stages"].values())
    spans = [
        {
            "schedule": c["schedule"],
            "m": c["m"],
            "span_median_s": c["span_median_s"],
            "ideal_span_solo_s": (c["m"] + 1) * fb,
            "span_over_ideal": c["span_median_s"] / ((c["m"] + 1) * fb),
            "bubble_if_solo_busy": 1 - c["m"] * fb / c["span_median_s"],
        }
        for c in res["configs"]
    ]
    waits = {f"{c['schedule']}.m{c['m']}": _waits(res, c["schedule"], c["m"]) for c in res["configs"]}
    return {
        "op_durations": ops,
        "overlap_slowdown": slowdown,
        "solo_f_plus_b_s": fb,
        "spans": spans,
        "waits": waits,
    }


def _waits(res: dict, schedule: str, m: int) -> dict:
    """Two costs the formula leaves out, from the timelines of 2 stages:

    ``handoff``: for each op that waited for the other stage (a forward on stage 1 for stage 0's forward of
    the same micro-batch, a backward on stage 0 for stage 1's backward), the time from the producing op's
    end to the waiting op's start: the Gloo send/recv of the activation or gradient plus the schedule's
    Python in between. ``overhead``: the gaps between consecutive ops of one stage whose input was already
    there (the schedule's own work between ops), summed per step on the stage with more, as a share of the
    span."""
    handoff, gaps, share = [], [], []
    for run in res["runs"]:
        if (run["schedule"], run["m"]) != (schedule, m):
            continue
        for step in run["per_step"].values():
            end = {(int(k), o[0], o[1]): o[3] for k, v in step["stages"].items() for o in v["ops"]}
            totals = []
            for k, v in step["stages"].items():
                r, seq = int(k), sorted(v["ops"], key=lambda o: o[2])
                total = 0.0
                for a, b in itertools.pairwise(seq):
                    dep = (
                        end.get((0, "F", b[1]))
                        if (r, b[0]) == (1, "F")
                        else end.get((1, "B", b[1]))
                        if (r, b[0]) == (0, "B")
                        else None
                    )
                    if dep is not None and dep > a[3]:
                        handoff.append(b[2] - dep)
                    else:
                        gaps.append(b[2] - a[3])
                        total += b[2] - a[3]
                totals.append(total)
            share.append(max(totals) / step["span_s"])
    return {
        "handoff_median_s": statistics.median(handoff) if handoff else None,
        "handoff_max_s": max(handoff) if handoff else None,
        "handoffs": len(handoff),
        "overhead_gap_median_s": statistics.median(gaps) if gaps else None,
        "overhead_share_of_span_median": statistics.median(share),
    }


def plot_bubble(res: dict, path: str) -> None:
    """Bubble vs m against (p-1)/(m+p-1), and the timelines of one m = 4 step of each schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ms = [1, 2, 4, 8]
    ax = axes[0]
    ax.plot(ms, [1 / (m + 1) for m in ms], "k--", label="(p-1)/(m+p-1), p = 2")
    for sched, mark in (("gpipe", "o"), ("1f1b", "s")):
        cs = [c for c in res["configs"] if c["schedule"] == sched]
        for st, color in (("0", "C0"), ("1", "C1")):
            ax.plot([c["m"] for c in cs], [c["stages"][st]["bubble_median"] for c in cs], marker=mark,
                    color=color, linestyle="-" if sched == "gpipe" else ":", label=f"{sched}, stage {st}")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("bubble = 1 - busy / span")
    ax.legend(fontsize=7)
    ax.set_title("measured bubble per stage (median)")
    for ax, sched in zip(axes[1:], ("gpipe", "1f1b"), strict=True):
        steps = [
            v for r in res["runs"] if (r["schedule"], r["m"]) == (sched, 4) for v in r["per_step"].values()
        ]
        step = sorted(steps, key=lambda v: v["span_s"])[len(steps) // 2]  # the step of median span
        for k, v in step["stages"].items():
            for kind, mb, a, b in v["ops"]:
                color = {"F": "C2", "B": "C3", "L": "C7"}[kind]
                ax.barh(int(k), b - a, left=a, color=color, edgecolor="k", height=0.6)
                if kind != "L":
                    ax.text((a + b) / 2, int(k), f"{kind}{mb}", ha="center", va="center", fontsize=7)
        ax.set_yticks([0, 1], ["stage 0", "stage 1"])
        ax.invert_yaxis()
        ax.set_xlabel("seconds from the step's first op")
        ax.set_title(f"{sched}, m = 4: one step (span {step['span_s']:.3f} s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- (d) memory per rank of the 4-rank layouts against the plan -----------------------------------------
D_LAYOUTS = {  # name -> flags shared by `paratrain train` and `paratrain plan`
    "fsdp+tp (dp_shard 2 x tp 2)": ["--strategy", "fsdp+tp", "--tp", "2", "--dp-shard", "2"],
    "fsdp+pp (pp 2 x dp_shard 2)": ["--strategy", "fsdp+pp", "--pp", "2", "--dp-shard", "2", "--microbatches", "4"],
}  # fmt: skip


def memory_layouts(args: argparse.Namespace) -> list[dict]:
    """``model_state_bytes_per_rank`` (at rest, after the run; the largest rank) and ``peak_bytes_per_rank``
    of 4-rank runs on llama-debug, against ``paratrain.plan.cli.predict_run`` with the same flags."""
    from paratrain.plan import cli as plan_cli

    rows = []
    for name, flags in D_LAYOUTS.items():
        common = ["--model", "llama-debug", "--seq-len", str(args.seq), "--batch-size", "16", *flags,
                  "--nproc-per-node", "4"]  # fmt: skip
        plan = plan_cli.predict_run(
            [*common, "--cluster", "cpu-local", "--precision", "fp32", "--optimizer", "adamw"]
        )
        with tempfile.TemporaryDirectory(prefix="bench_mem_") as run_dir:
            cmd = [sys.executable, "-m", "paratrain", "train", *common, "--data", "python-stdlib", "--set",
                   "data.max_bytes=200000", "--steps", "3", "--json", "--run-dir", run_dir, "--ckpt-every", "0"]  # fmt: skip
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
            if p.returncode:
                raise RuntimeError(p.stderr[-3000:])
        s = json.loads(p.stdout.strip().splitlines()[-1])
        row = {
            "layout": name,
            "flags": common,
            "topology": s["topology"],
            "num_params": s["num_params"],
            "predicted_model_state_bytes_per_rank": plan["model_state_bytes_per_rank"],
            "measured_model_state_bytes_per_rank": s["model_state_bytes_per_rank"],
            "ratio_state": plan["model_state_bytes_per_rank"] / s["model_state_bytes_per_rank"],
            "predicted_bytes_per_rank": plan["bytes_per_rank"],
            "measured_peak_bytes_per_rank": s["peak_bytes_per_rank"],
            "ratio_peak": plan["bytes_per_rank"]["peak"] / s["peak_bytes_per_rank"] if s["peak_bytes_per_rank"] else None,
            "plan_layout": plan["layout"],
        }  # fmt: skip
        rows.append(row)
        print(f"{name:30s} state: predicted {row['predicted_model_state_bytes_per_rank']:>10,} measured "
              f"{row['measured_model_state_bytes_per_rank']:>10,} ratio {row['ratio_state']:.4f}; peak: predicted "
              f"{plan['bytes_per_rank']['peak']:>10,} measured {s['peak_bytes_per_rank']}", flush=True)  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
