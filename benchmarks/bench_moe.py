"""Mixture of experts on CPU ranks: all-to-all bytes against the formula, step time under ep against ddp,
memory against the planner, and paratrain's pairwise all-to-all against Gloo's.

Three parts (``--part``), each stored under ``benchmarks/results/moe_<part>.json`` with the conditions (CPU
count, ranks, the load average measured before each run):

- ``volume``: ``llama-moe-small`` under ``ep`` on 2 and 4 ranks, one forward and backward; every all-to-all of
  token rows is counted where it is called (``paratrain.comm.all_to_all`` wrapped: the rows a rank sends to
  the *other* ranks, dispatch and combine, forward and backward), against the planner's formula
  ``2 * top_k * tokens * dim * (ep - 1) / ep`` elements per MoE layer and direction (uniform routing), with
  the random router of the initialised model and with every token forced to expert 0.
- ``step``: ``paratrain train --model llama-moe-small`` under ``ep`` and under ``ddp`` (experts replicated) on
  the same 2 and 4 ranks: tokens/s, ``model_state_bytes_per_rank`` and ``peak_bytes_per_rank`` against
  ``paratrain plan`` for the same run.
- ``alltoall``: even-split all-to-all of S bytes per rank, 4 KB to 16 MB, on 2 and 4 ranks: Gloo's
  ``all_to_all_single`` against :func:`paratrain.comm.all_to_all` (pairwise); median of ``--iters`` calls,
  the slowest rank's time; busbw as nccl-tests' alltoall (algbw x (n - 1) / n).

    python benchmarks/bench_moe.py --part all --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
SEQ, BATCH = 128, 8


# ---- volume --------------------------------------------------------------------------------------------------
def _volume_worker(force: int | None) -> dict[str, Any]:
    from paratrain import comm
    from paratrain.data import Batch
    from paratrain.models.llama import build_llama
    from paratrain.models.moe import moe_layers
    from paratrain.parallel import expert, setup
    from paratrain.runtime import init
    from paratrain.train.precision import Precision

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_llama("llama-moe-small", {"max_seq_len": SEQ})
    for m in moe_layers(model):
        m.force_expert = force
    model, _, strat = setup(model, None, strategy="ep", ctx=init(seed=None))
    counted = {"rows_bytes": 0, "count_bytes": 0, "calls": 0}
    real = comm.all_to_all

    def counting(x: torch.Tensor, recv: Any, send: Any, **kw: Any) -> torch.Tensor:
        me = dist.get_rank(kw.get("group"))
        nbytes = (sum(send) - send[me]) * (x[0].numel() if x.shape[0] else 0) * x.element_size()
        key = "count_bytes" if x.dtype == torch.int64 else "rows_bytes"
        counted[key] += nbytes
        counted["calls"] += 1
        return real(x, recv, send, **kw)

    expert.comm.all_to_all = counting  # type: ignore[attr-defined]
    try:
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        per_rank = BATCH // dist.get_world_size()
        x = torch.randint(0, 256, (per_rank, SEQ), generator=g)
        loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())  # noqa: E731
        strat.forward_backward(model, Batch(x, x), loss_fn, Precision("fp32", torch.device("cpu")), 1)
    finally:
        expert.comm.all_to_all = real  # type: ignore[attr-defined]
    cfg = model.config
    n_moe = len(moe_layers(model))
    ep = strat.topology.ep
    tokens = per_rank * SEQ
    formula = 2 * n_moe * 2 * cfg.top_k * tokens * cfg.dim * (ep - 1) / ep * 4  # fwd + bwd, fp32
    return {"rank": dist.get_rank(), "counted_rows_bytes": counted["rows_bytes"],
            "counted_count_bytes": counted["count_bytes"], "all_to_all_calls": counted["calls"],
            "formula_bytes": formula, "ratio": counted["rows_bytes"] / formula}  # fmt: skip


def part_volume(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    for ranks in (2, 4):
        for force in (None, 0):
            load = os.getloadavg()[0]
            per_rank = run_distributed(_volume_worker, ranks, args=(force,), timeout_s=900,
                                       env={"OMP_NUM_THREADS": "1"})  # fmt: skip
            total = sum(r["counted_rows_bytes"] for r in per_rank)
            formula = sum(r["formula_bytes"] for r in per_rank)
            runs.append({"ranks": ranks, "routing": "random" if force is None else "all to expert 0",
                         "load_avg_before": load, "per_rank": per_rank, "counted_total": total,
                         "formula_total": formula, "ratio": total / formula})  # fmt: skip
            print(f"volume: {ranks} ranks, {runs[-1]['routing']}: counted {total / 2**20:.2f} MiB, formula "
                  f"{formula / 2**20:.2f} MiB, ratio {total / formula:.3f}; per rank "
                  + ", ".join(f"{r['ratio']:.2f}" for r in per_rank))  # fmt: skip
    return {"runs": runs}


# ---- step time and memory --------------------------------------------------------------------------------------
def _cli(*argv: str, cwd: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "paratrain", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"paratrain {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def part_step(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    runs = []
    for ranks in (2, 4):
        for strategy in ("ep", "ddp"):
            load = os.getloadavg()[0]
            s = _cli("train", "--model", "llama-moe-small", "--data", "python-stdlib", "--set",
                     "data.max_bytes=400000", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--steps",
                     str(args.steps), "--strategy", strategy, "--nproc-per-node", str(ranks), "--set",
                     "checkpoint.save_at_end=false", "--set", "train.eval_every=0", "--json", cwd=workdir)  # fmt: skip
            p = _cli("plan", "--model", "llama-moe-small", "--strategy", strategy, "--nproc-per-node", str(ranks),
                     "--cluster", "cpu-local", "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--json",
                     cwd=workdir)["plans"][0]  # fmt: skip
            row = {"ranks": ranks, "strategy": strategy, "load_avg_before": load,
                   "tokens_per_s": s["tokens_per_s"], "train_time_s": s["train_time_s"], "steps": s["steps"],
                   "model_state_bytes_per_rank": s["model_state_bytes_per_rank"],
                   "peak_bytes_per_rank": s["peak_bytes_per_rank"],
                   "plan_model_state_bytes_per_rank": p["model_state_bytes_per_rank"],
                   "plan_peak_bytes_per_rank": p["bytes_per_rank"]["peak"], "final_loss": s["final_loss"],
                   "moe": s.get("moe")}  # fmt: skip
            row["states_vs_plan"] = row["model_state_bytes_per_rank"] / row["plan_model_state_bytes_per_rank"]
            row["peak_vs_plan"] = (row["peak_bytes_per_rank"] or 0) / row["plan_peak_bytes_per_rank"]
            runs.append(row)
            print(f"step: {strategy} on {ranks} ranks: {row['tokens_per_s']:.0f} tokens/s, states "
                  f"{row['model_state_bytes_per_rank'] / 2**20:.1f} MiB ({row['states_vs_plan']:.3f} x plan), peak "
                  f"{(row['peak_bytes_per_rank'] or 0) / 2**20:.1f} MiB ({row['peak_vs_plan']:.3f} x plan)")  # fmt: skip
    return {"runs": runs, "seq_len": SEQ, "global_batch": BATCH}


# ---- all-to-all -------------------------------------------------------------------------------------------------
def _a2a_worker(sizes: list[int], iters: int) -> dict[str, Any]:
    from paratrain import comm

    torch.set_num_threads(1)
    n = dist.get_world_size()
    out: dict[str, Any] = {}
    for size in sizes:
        x = torch.ones(size // 4)
        splits = [x.numel() // n] * n
        x = x[: sum(splits)]
        ref = torch.empty_like(x)
        calls = {
            "native": lambda x=x, ref=ref, sp=splits: dist.all_to_all_single(ref, x, sp, sp),
            "pairwise": lambda x=x, sp=splits: comm.all_to_all(x, sp, sp, algorithm="pairwise", check=False),
        }
        times: dict[str, list[float]] = {k: [] for k in calls}
        for it in range(iters + 2):
            for k in list(calls)[it % 2 :] + list(calls)[: it % 2]:
                dist.barrier()
                t0 = time.perf_counter()
                calls[k]()
                if it >= 2:
                    times[k].append(time.perf_counter() - t0)
        t = torch.tensor([times[k] for k in calls], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med = {k: statistics.median(v) for k, v in zip(calls, t.tolist(), strict=True)}
        nbytes = x.numel() * 4
        out[str(size)] = {k: {"time_s": med[k], "busbw_GBps": nbytes / med[k] * (n - 1) / n / 1e9,
                              "vs_native": med["native"] / med[k]} for k in calls}  # fmt: skip
    return out


def part_alltoall(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
    runs = []
    for ranks in (2, 4):
        for r in range(args.runs):
            load = os.getloadavg()[0]
            res = run_distributed(_a2a_worker, ranks, args=(sizes, args.iters), timeout_s=900,
                                  env={"OMP_NUM_THREADS": "1"})[0]  # fmt: skip
            runs.append({"ranks": ranks, "run": r, "load_avg_before": load, "sizes": res})
            print(f"all-to-all, {ranks} ranks, run {r + 1}: " + "; ".join(
                f"{int(s) >> 10} KB pairwise {v['pairwise']['busbw_GBps']:.2f} vs native "
                f"{v['native']['busbw_GBps']:.2f} GB/s ({v['pairwise']['vs_native']:.2f}x)" for s, v in res.items()))  # fmt: skip
    return {"runs": runs, "iters": args.iters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("volume", "step", "alltoall", "all"), default="all")
    ap.add_argument("--steps", type=int, default=6, help="training steps of the step part")
    ap.add_argument("--runs", type=int, default=2, help="runs of the all-to-all part")
    ap.add_argument("--iters", type=int, default=15, help="timed calls per size and variant")
    ap.add_argument("--json", action="store_true", help="store benchmarks/results/moe_<part>.json")
    args = ap.parse_args()
    parts = ("volume", "step", "alltoall") if args.part == "all" else (args.part,)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / "paratrain-bench-moe"
    workdir.mkdir(parents=True, exist_ok=True)
    for part in parts:
        conditions = {"cpus": os.cpu_count(), "load_avg_before": os.getloadavg()[0],
                      "torch": torch.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
                      "note": "shared 2-core machine, loaded by other engineers' jobs"}  # fmt: skip
        if part == "volume":
            result = part_volume(args)
        elif part == "step":
            result = part_step(args, workdir)
        else:
            result = part_alltoall(args)
        if args.json:
            RESULTS.mkdir(exist_ok=True)
            path = RESULTS / f"moe_{part}.json"
            stored = json.loads(path.read_text()) if path.exists() else {"runs": []}
            stored["runs"].append({"conditions": conditions, **result})
            path.write_text(json.dumps(stored, indent=1))
            print(f"stored {path}")


if __name__ == "__main__":
    main()
