"""Sharded data parallel, measured side by side in one run: memory per rank, communication per step, step time.

For ddp, zero1, zero2 and zero3 on N = 1, 2, 4 Gloo ranks (one process group per N, every strategy in it):

- **memory at rest**: ``model_state_bytes`` after a few AdamW steps (local shards of parameters, gradients
  and optimizer state actually held between steps), largest over ranks, against the ZeRO paper's formulas
  for fp32 Adam: ddp 16Ψ, zero1 8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, zero3 16Ψ/N;
- **peak memory during a step**: ``paratrain.train.memory.measure_peak`` around one step (PyTorch's
  ``MemTracker``: the live bytes of parameters, gradients, optimizer state, activations, temporaries and the
  communication buffers created in the step: zero1/zero2's send buffers, FSDP's unsharded units), largest
  over ranks. It does not see storage allocated before the step outside the dispatcher: torch DDP's C++
  gradient buckets (4Ψ more for ddp). The formulas describe the state at rest, not this peak;
- **communication**: bytes sent per rank in one optimizer step, *counted* from the collectives the
  process group actually ran (every ``c10d::`` op in a torch.profiler trace of the step, DDP's C++ reducer
  included), converted with the bandwidth-optimal (ring) cost of each collective: all-reduce
  2(N-1)/N·n, reduce-scatter (N-1)/N·n (n = its input), all-gather (N-1)/N·n (n = its output).
  Formula: 2Ψ·(N-1)/N elements for ddp, zero1, zero2; 3Ψ·(N-1)/N for zero3;
- **step time**: median of timed steps; ratios to ddp on the same model and N.

    python benchmarks/bench_zero.py            # table (about 2-3 minutes on 2 idle cores)
    python benchmarks/bench_zero.py --json     # one JSON object
    python benchmarks/bench_zero.py --quick    # a smoke run: small model, N = 1, 2

The raw result (every row, the command, the machine's load average) is written to ``--out``
(default ``benchmarks/results/zero.json``; ``--out ''`` writes nothing).
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

import torch
import torch.distributed as dist
from torch import nn

STRATEGIES = ["ddp", "zero1", "zero2", "zero3"]
RESULTS = Path(__file__).resolve().parent / "results" / "zero.json"
_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "long int": 8, "int": 4}


def formula_bytes(name: str, psi: int, n: int) -> float:
    """fp32 AdamW model-state bytes per rank (ZeRO paper section 5 with 4 + 4 + 8 bytes per parameter)."""
    return {
        "ddp": 16 * psi,
        "zero1": 8 * psi + 8 * psi / n,
        "zero2": 4 * psi + 12 * psi / n,
        "zero3": 16 * psi / n,
    }[name]


def formula_comm(name: str, psi: int, n: int, elem: int = 4) -> float:
    """Bytes sent per rank per step with ring collectives: 2Ψ (ddp, zero1, zero2) or 3Ψ (zero3), x (N-1)/N."""
    return (3 if name == "zero3" else 2) * psi * elem * (n - 1) / n


def _sent_bytes(events: list[dict[str, Any]], n: int) -> tuple[int, dict[str, int]]:
    """Per-rank bytes sent by the c10d collectives in a chrome trace, by ring cost; and a count per op."""
    total, counts = 0.0, {}
    for e in events:
        name = e.get("name", "")
        if not name.startswith("c10d::"):
            continue
        args = e.get("args", {})
        dims, types = args.get("Input Dims", []), args.get("Input type", [])
        op = name.split("::")[1].rstrip("_")
        counts[op] = counts.get(op, 0) + 1
        if op in (
            "allreduce",
            "_reduce_scatter_base",
            "_allgather_base",
            "reduce_scatter_tensor_coalesced",
            "allgather_into_tensor_coalesced",
        ):
            if op == "allreduce":  # (TensorList, ...)
                numel = sum(_numel(d) for d in dims[0])
                elem = _DTYPE_BYTES.get(types[0], 4) if types and types[0] != "TensorList" else 4
                total += 2 * (n - 1) / n * numel * elem
            elif op == "_reduce_scatter_base":  # (output, input)
                total += (n - 1) / n * _numel(dims[1]) * _DTYPE_BYTES.get(types[1], 4)
            elif op == "_allgather_base":  # (output, input)
                total += (n - 1) / n * _numel(dims[0]) * _DTYPE_BYTES.get(types[0], 4)
        elif op not in ("barrier",):
            raise RuntimeError(f"bench_zero: collective {name} is not costed; add it to _sent_bytes")
    return int(total), counts


def _numel(dims: list[int]) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


def _model(args: argparse.Namespace) -> nn.Module:
    from paratrain.models.mlp import MLP

    torch.manual_seed(0)
    return MLP(args.features, args.hidden, args.layers, 10)


def _prepare(name: str, args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """Set up ``name``, warm it up, measure its memory and count one step's communication."""
    from torch.profiler import ProfilerActivity, profile

    from paratrain.parallel import model_state_bytes, setup
    from paratrain.runtime import init
    from paratrain.train.memory import measure_peak

    ctx = init(seed=None)
    n = dist.get_world_size()
    model = _model(args)
    psi = sum(p.numel() for p in model.parameters())
    model, opt, _ = setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4), strategy=name, ctx=ctx)
    g = torch.Generator().manual_seed(dist.get_rank())
    local = args.batch // n
    x = torch.randn(local, args.features, generator=g)
    y = torch.randint(0, 10, (local,), generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    held = torch.tensor([model_state_bytes(model, opt)])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    _, peak = measure_peak(step, model, opt)  # one more step, under the tracker
    peak_t = torch.tensor([peak if peak is not None else -1])
    dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    sent, counts = _sent_bytes(events, n)
    sent_t = torch.tensor([sent])
    dist.all_reduce(sent_t, op=dist.ReduceOp.MAX)
    row = {
        "strategy": name,
        "world_size": n,
        "psi": psi,
        "bytes": int(held),
        "peak_bytes": int(peak_t) if int(peak_t) >= 0 else None,
        "formula_bytes": formula_bytes(name, psi, n),
        "comm_bytes": int(sent_t),
        "formula_comm": formula_comm(name, psi, n),
        "collectives": counts,
    }
    return row, step


def _all(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    prepared = [_prepare(name, args) for name in args.strategies]
    # Timed steps interleave the strategies round by round, so that load from other processes on a
    # shared machine falls on all of them alike; the median over rounds is reported.
    times: list[list[float]] = [[] for _ in prepared]
    for _ in range(args.steps):
        for i, (_row, step) in enumerate(prepared):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[i].append(time.perf_counter() - t0)
    rows = []
    for (row, _step), ts in zip(prepared, times, strict=True):
        t = torch.tensor([statistics.median(ts)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append(dict(row, step_s=float(t)))
    return rows


def main(argv: list[str] | None = None) -> int:
    from paratrain.testing import run_distributed

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--strategies", nargs="+", default=STRATEGIES)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=6, help="hidden layers (6 x 1024 wide: 5.3M parameters)")
    p.add_argument("--batch", type=int, default=64, help="global batch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps per strategy")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true", help="smoke run: MLP 64->256x2->10, N = 1, 2, 3 steps")
    p.add_argument("--out", default=str(RESULTS), help="where to store the raw JSON ('' for nowhere)")
    args = p.parse_args(argv)
    if args.quick:
        args.world_sizes, args.hidden, args.layers, args.steps, args.warmup = [1, 2], 256, 2, 3, 1
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for n in args.world_sizes:
        rows += run_distributed(_all, n, args=(args,), timeout_s=900)[0]
    by = {(r["strategy"], r["world_size"]): r for r in rows}
    for r in rows:
        base = by.get(("ddp", r["world_size"]))
        r["step_ratio_vs_ddp"] = r["step_s"] / base["step_s"] if base else None
        r["bytes_ratio"] = r["bytes"] / r["formula_bytes"]
        r["comm_ratio"] = r["comm_bytes"] / r["formula_comm"] if r["formula_comm"] else None
    result = {
        "command": "python benchmarks/bench_zero.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
        "psi": rows[0]["psi"],
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),  # other work on the machine: it distorts the step times, not the bytes
        "elapsed_s": time.perf_counter() - t_start,
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"model: MLP {args.features}->{args.hidden}x{args.layers}->10, Ψ = {rows[0]['psi']:,} parameters, "
        f"fp32 AdamW, global batch {args.batch}, Gloo on CPU ({os.cpu_count()} cores, load average "
        f"{result['load_avg'][0]:.1f})"
    )
    print(
        f"{'strategy':8} {'N':>2} {'at rest MiB':>11} {'formula':>9} {'ratio':>6} {'peak MiB':>9} "
        f"{'comm MiB':>9} {'formula':>8} {'ratio':>6} {'ms/step':>8} {'vs ddp':>6}"
    )
    for r in rows:
        comm_ratio = f"{r['comm_ratio']:.3f}" if r["comm_ratio"] is not None else "-"
        peak = f"{r['peak_bytes'] / 2**20:9.2f}" if r["peak_bytes"] is not None else f"{'-':>9}"
        print(
            f"{r['strategy']:8} {r['world_size']:>2} {r['bytes'] / 2**20:11.2f} "
            f"{r['formula_bytes'] / 2**20:9.2f} "
            f"{r['bytes_ratio']:6.3f} {peak} {r['comm_bytes'] / 2**20:9.2f} {r['formula_comm'] / 2**20:8.2f} "
            f"{comm_ratio:>6} {r['step_s'] * 1e3:8.1f} {r['step_ratio_vs_ddp']:6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
