"""One workload under every peer and paratrain, side by side in the same processes: step time, samples/s, peak memory.

The workload: an MLP 1024 → 2048 → 2048 → 10 (Ψ = 6,316,042 parameters, 25.3 MB of fp32 gradients per
step), per-rank batch ``--batch`` of random inputs, cross-entropy, SGD with momentum, fp32, Gloo on CPU,
one thread per rank. Its step is about half gradient communication on 2 ranks of this machine, which is
what a faster transport can show.

Runners (each builds its own copy of the same model from the same seed, in the same worker processes):

- ``torch-ddp``: the hand-written loop of ``benchmarks/plain_ddp.py`` (torch DDP, nothing else);
  ``torch-ddp/2``, a second copy of it, is the control: how far it lands from 1.000x is the noise;
- ``accelerate``: ``Accelerator(cpu=True).prepare(model, opt)``, ``accelerator.backward``;
- ``fabric``: Lightning Fabric, ``strategy="ddp"``, ``fabric.setup`` / ``fabric.backward``;
- ``deepspeed-z1`` / ``deepspeed-z2``: ``deepspeed.initialize`` with ZeRO stage 1 / 2 on its CPU
  accelerator (``DS_ACCELERATOR=cpu``; without oneCCL it communicates through Gloo), the same SGD as a
  client optimizer, 25 MiB reduce/all-gather buckets like DDP's; reported as an error when it does not
  run;
- ``paratrain-ddp``, ``paratrain-dp``, ``paratrain-ddp+shm``, ``paratrain-dp+shm``, ``paratrain-zero2``:
  ``Trainer.train_step`` of ``paratrain train --strategy ...`` (its data loader, precision, scheduler).

Timing: ``--rounds`` rounds; in each, every runner (rotating order) runs ``--steps`` steps between two
barriers; a round's time is its slowest rank's; the figure is the median over rounds of the per-round
step time, and "vs torch-ddp" is the median of the per-round ratios (so a slow phase of the machine hits
all runners alike). Peak memory: torch's ``MemTracker`` around one more step of each runner: the live
tensor bytes it sees (parameters, gradients, optimizer state, activations, temporaries). It does not see
storage allocated outside the dispatcher before the step (torch DDP's C++ gradient buckets, 4Ψ = 25.3 MB,
and ``dp``'s bucket buffers). For ``shm`` runners the mapped segment counts as training counts it
(``paratrain.train.memory.register_transport``): only ``dp``'s zero-copy gradients that live in it; the
slots are transport, like Gloo's buffers.

    python benchmarks/bench_peers.py                         # 2 ranks, every runner (a few minutes)
    python benchmarks/bench_peers.py --scaling 1,2,4         # plus the scaling table (a subset of runners)
    python benchmarks/bench_peers.py --json                  # writes benchmarks/results/peers.json

Peers are optional: ``pip install -e '.[bench]'`` installs the pinned versions; a missing one is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RUNNERS = (
    "torch-ddp", "torch-ddp/2", "accelerate", "fabric", "deepspeed-z1", "deepspeed-z2", "paratrain-ddp",
    "paratrain-dp", "paratrain-ddp+shm", "paratrain-dp+shm", "paratrain-zero2",
)  # fmt: skip
SCALING_RUNNERS = ("torch-ddp", "paratrain-ddp", "paratrain-ddp+shm", "paratrain-dp+shm")
D_IN, HIDDEN, LAYERS, CLASSES = 1024, 2048, 2, 10

Step = Callable[[], Any]


# ---- the runners (worker side) ------------------------------------------------------------------------
def _model() -> Any:
    import torch

    from paratrain.models.mlp import MLP

    torch.manual_seed(0)
    return MLP(D_IN, HIDDEN, LAYERS, CLASSES)


def _batches(rank: int, world: int, batch: int) -> Callable[[], tuple[Any, Any]]:
    """This rank's batches: the same data set and the same order (paratrain's sampler, seed 0) as the
    paratrain runners' ``bench-vectors`` set, so that every runner computes the same steps."""
    import torch

    from paratrain.data import DistributedBatchSampler

    g = torch.Generator().manual_seed(0)
    n = max(512, 4 * batch * world)
    x, y = torch.randn(n, D_IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    sampler = DistributedBatchSampler(n, batch * world, rank, world, seed=0)

    def next_batch() -> tuple[Any, Any]:
        idx = sampler.next_batch()
        return x[idx], y[idx]

    return next_batch


PARAM_TOL = 1e-4
"""Largest relative L2 difference of a runner's final parameters from torch DDP's after the same steps: a
runner further away did not compute the same thing, and its time is not reported."""


def _param_vector(model: Any) -> Any:
    """The full parameters of ``model`` (wrappers unwrapped, DTensors gathered) as one float64 vector."""
    import torch

    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    parts = []
    for p in model.parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        parts.append(t.detach().reshape(-1).double())
    return torch.cat(parts)


def _loop(model: Any, opt: Any, backward: Callable[[Any], None], data: Callable[[], tuple[Any, Any]]) -> Step:
    import torch

    def step() -> Any:
        xb, yb = data()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        backward(loss)
        opt.step()
        return loss.detach()

    return step


def _sgd(params: Any, lr: float) -> Any:
    import torch

    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _build(name: str, args: argparse.Namespace, ctx: Any, run_dir: str) -> tuple[Step, Any, Any]:
    """(one training step, model, optimizer) of runner ``name``."""
    data = _batches(ctx.rank, ctx.world_size, args.batch)
    if name.startswith("torch-ddp"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import plain_ddp

        model, opt = plain_ddp.build(_model(), ctx.device, lr=args.lr)
        return _loop(model, opt, lambda loss: loss.backward(), data), model, opt
    if name == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=True)
        model = _model()
        model, opt = acc.prepare(model, _sgd(model.parameters(), args.lr))
        return _loop(model, opt, acc.backward, data), model, opt
    if name == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=ctx.world_size)
        fabric.launch()  # under torchrun's environment: joins the existing process group
        model = _model()
        model, opt = fabric.setup(model, _sgd(model.parameters(), args.lr))
        return _loop(model, opt, fabric.backward, data), model, opt
    if name.startswith("deepspeed"):
        import deepspeed

        model = _model()
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(name[-1])},
            "zero_allow_untested_optimizer": True,
            # DDP's 25 MiB buckets instead of DeepSpeed's 5e8-element default (2 GB of fp32 buffers)
            "reduce_bucket_size": 25 * 2**20 // 4,
            "allgather_bucket_size": 25 * 2**20 // 4,
            "steps_per_print": 10**9,
        }
        engine, opt, _, _ = deepspeed.initialize(
            model=model, optimizer=_sgd(model.parameters(), args.lr), config=config, dist_init_required=False
        )

        def ds_step() -> Any:
            import torch

            xb, yb = data()
            loss = torch.nn.functional.cross_entropy(engine(xb), yb)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return ds_step, engine, opt
    from paratrain.config import RunConfig
    from paratrain.data import Splits, TensorData, register_dataset
    from paratrain.train.worker import build_trainer

    strategy, _, algorithm = name.removeprefix("paratrain-").partition("+")
    if "bench-vectors" not in _registered:
        _registered.add("bench-vectors")

        @register_dataset("bench-vectors")
        def _vectors(cfg: Any) -> Splits:
            import torch

            g = torch.Generator().manual_seed(0)
            x = torch.randn(cfg.num_samples, D_IN, generator=g)
            y = torch.randint(0, CLASSES, (cfg.num_samples,), generator=g)
            return Splits(TensorData(x, y), TensorData(x[:64], y[:64]), "classification", (D_IN,), CLASSES)

    cfg = RunConfig().override([
        f"strategy.name={strategy}", f"strategy.comm_algorithm={algorithm or 'native'}",
        "model.name=mlp", f"model.hidden={HIDDEN}", f"model.layers={LAYERS}", "data.name=bench-vectors",
        f"data.num_samples={max(512, 4 * args.batch * ctx.world_size)}",
        f"train.batch_size={args.batch * ctx.world_size}", "train.steps=1000000", "train.epochs=none",
        "optimizer.name=sgd", f"optimizer.lr={args.lr}", "optimizer.momentum=0.9", "train.progress=false",
        "checkpoint.save_at_end=false", "train.log_every=1000000", f"train.run_dir={run_dir}",
    ])  # fmt: skip
    import torch

    torch.manual_seed(0)  # the same initial parameters as _model(), whatever was built before in this process
    trainer = build_trainer(cfg, ctx, Path(run_dir) / name.replace("+", "-"))
    return trainer.train_step, trainer.model, trainer.optimizer


_registered: set[str] = set()


def _peak_bytes(name: str, step: Step, model: Any, opt: Any) -> int | None:
    import torch

    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        from paratrain.train.memory import register_transport

        tracker = MemTracker()
        # The shm segments count only this rank's zero-copy gradients, as in training, and only for the runner
        # whose gradients they are (every runner's segments are mapped in these processes).
        register_transport(tracker, owned=name == "paratrain-dp+shm")
        externals = [m for m in (model,) if isinstance(m, torch.nn.Module)]
        externals += [o for o in (opt, getattr(opt, "optim", None)) if isinstance(o, torch.optim.Optimizer)]
        tracker.track_external(*externals)
        with tracker:
            step()
        peak = tracker.get_tracker_snapshot("peak")
        return int(max(v.get("Total", 0) for v in peak.values()))
    except Exception:
        return None


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from paratrain.runtime import init

    ctx = init(seed=0)
    torch.set_num_threads(1)
    names = [n for n in args.runners.split(",") if n]
    run_dir = str(Path(args.out).parent / "paratrain-runs")  # the driver's temporary directory, every rank's
    steps: dict[str, Step] = {}
    errors: dict[str, str] = {}
    built: dict[str, tuple[Any, Any]] = {}
    for name in names:
        ok = torch.tensor([1])
        try:
            step, model, opt = _build(name, args, ctx, run_dir)
            for _ in range(args.warmup):
                step()
        except Exception as e:  # a peer that does not run here is reported, not fatal
            ok[0] = 0
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        if ctx.world_size > 1:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank drops the same runners
        if ok.item():
            steps[name], built[name] = step, (model, opt)
        elif name not in errors:
            errors[name] = "failed on another rank"
    order = list(steps)
    wall: dict[str, list[float]] = {n: [] for n in order}
    cpu: dict[str, list[float]] = {n: [] for n in order}

    def barrier() -> None:
        if ctx.world_size > 1:
            dist.barrier()

    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                steps[name]()
            barrier()
            wall[name].append((time.perf_counter() - t0) / args.steps)
            cpu[name].append((time.process_time() - c0) / args.steps)
    table = torch.tensor([wall[n] for n in order], dtype=torch.float64)
    cpu_t = torch.tensor([cpu[n] for n in order], dtype=torch.float64)
    peaks = torch.tensor([_peak_bytes(n, steps[n], *built[n]) or -1 for n in order], dtype=torch.float64)
    # every runner took the same steps on the same batches: its parameters must be torch DDP's
    ref = _param_vector(built["torch-ddp"][0]) if "torch-ddp" in built else None
    diffs = {}
    for n in order:
        got = _param_vector(built[n][0])
        diffs[n] = (
            float((got - ref).norm() / ref.norm()) if ref is not None and got.shape == ref.shape else None
        )
    if ctx.world_size > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX)  # a round ends when its slowest rank does
        dist.all_reduce(cpu_t)  # CPU seconds summed over ranks
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    if ctx.rank == 0:
        rows = {
            n: {
                "step_s": table[i].tolist(),
                "cpu_s": cpu_t[i].tolist(),
                "peak_bytes": int(peaks[i].item()),
                "param_rel_diff_vs_torch_ddp": diffs[n],
            }
            for i, n in enumerate(order)
        }
        Path(args.out).write_text(json.dumps({"world_size": ctx.world_size, "rows": rows, "errors": errors}))
    barrier()
    os._exit(0)  # skip interpreter teardown with live peer process groups and worker threads


# ---- the driver ---------------------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for pkg in ("torch", "accelerate", "lightning", "deepspeed"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _launch(args: argparse.Namespace, world: int, runners: str, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", str(world), __file__, "--worker",
            "--out", str(out), "--runners", runners, "--rounds", str(rounds), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--batch", str(args.batch), "--lr", str(args.lr),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if not out.exists():
            raise SystemExit(f"bench_peers: {world} ranks failed:\n{proc.stderr[-4000:]}")
        return dict(json.loads(out.read_text()))


def summarize(result: dict[str, Any], batch: int, base: str = "torch-ddp") -> list[dict[str, Any]]:
    """One row per runner; a runner whose final parameters are not torch DDP's (beyond ``PARAM_TOL``) moves
    to ``result["errors"]`` instead: its time would not be the time of the same work."""
    rows, world = result["rows"], result["world_size"]
    out = []
    for name, r in list(rows.items()):
        diff = r.get("param_rel_diff_vs_torch_ddp")
        if base in rows and (diff is None or diff > PARAM_TOL):
            result["errors"][name] = (
                f"its final parameters differ from torch DDP's by {diff} (relative L2, tolerance {PARAM_TOL}): "
                "it did not compute the same steps"
            )
            continue
        ratios = (
            [b / t for b, t in zip(rows[base]["step_s"], r["step_s"], strict=True)] if base in rows else []
        )
        step = statistics.median(r["step_s"])
        out.append({
            "runner": name, "world_size": world, "step_ms": step * 1e3,
            "step_ms_min": min(r["step_s"]) * 1e3, "step_ms_max": max(r["step_s"]) * 1e3,
            "speedup_vs_torch_ddp": statistics.median(ratios) if ratios else None,
            "samples_per_s": world * batch / step, "cpu_ms_per_step": statistics.median(r["cpu_s"]) * 1e3,
            "peak_MB": r["peak_bytes"] / 1e6 if r["peak_bytes"] >= 0 else None, "rounds": len(r["step_s"]),
            "param_rel_diff_vs_torch_ddp": diff,
        })  # fmt: skip
    return out


def markdown(summary: list[dict[str, Any]], errors: dict[str, str]) -> str:
    lines = [
        "| runner | ms/step (median) | min-max | speed-up vs torch-ddp | samples/s | CPU ms/step (all ranks) "
        "| peak MB (MemTracker) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        sp = f"**{r['speedup_vs_torch_ddp']:.2f}x**" if r["speedup_vs_torch_ddp"] else "-"
        peak = f"{r['peak_MB']:.1f}" if r["peak_MB"] is not None else "n/a"
        lines.append(
            f"| {r['runner']} | {r['step_ms']:.1f} | {r['step_ms_min']:.0f}-{r['step_ms_max']:.0f} | {sp} | "
            f"{r['samples_per_s']:.0f} | {r['cpu_ms_per_step']:.1f} | {peak} |"
        )
    for name, err in errors.items():
        lines.append(f"| {name} | did not run: {err} | | | | | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(RESULTS / "peers.json"))
    p.add_argument("--runners", default=",".join(RUNNERS))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--scaling", default="", help="world sizes for the scaling table, e.g. 1,2,4")
    p.add_argument("--scaling-rounds", type=int, default=6)
    p.add_argument("--json", action="store_true", help="write --out and print it")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    load_before = os.getloadavg()
    res = _launch(args, args.world_size, args.runners, args.rounds)
    result: dict[str, Any] = {
        "versions": _versions(), "cores": os.cpu_count(), "load_avg_before": load_before,
        "workload": {"model": f"MLP {D_IN}-{HIDDEN}x{LAYERS}-{CLASSES}", "params": 6_316_042,
                     "per_rank_batch": args.batch, "optimizer": "SGD momentum 0.9", "dtype": "fp32"},
        "spec": vars(args), "peers": summarize(res, args.batch), "errors": res["errors"], "raw": res,
    }  # fmt: skip
    print(markdown(result["peers"], res["errors"]), file=sys.stderr)
    if args.scaling:
        scaling = []
        for world in [int(w) for w in args.scaling.split(",")]:
            r = _launch(args, world, ",".join(SCALING_RUNNERS), args.scaling_rounds)
            scaling += summarize(r, args.batch)
        base = {s["runner"]: s["samples_per_s"] for s in scaling if s["world_size"] == 1}
        for s in scaling:
            if s["runner"] in base:
                s["speedup"] = s["samples_per_s"] / base[s["runner"]]
                s["efficiency"] = s["speedup"] / s["world_size"]
        result["scaling"] = scaling
        for s in scaling:
            print(
                f"{s['runner']:>20} N={s['world_size']}: {s['samples_per_s']:.0f} samples/s, "
                f"speed-up {s.get('speedup', float('nan')):.2f}, efficiency {s.get('efficiency', float('nan')):.0%}",
                file=sys.stderr,
            )
    result["load_avg_after"] = os.getloadavg()
    if args.json:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps(result))


if __name__ == "__main__":
    main()
