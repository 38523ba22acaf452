"""Issue 11 benchmarks, part (a): ``paratrain train --strategy single`` against a plain torch loop.

(a) tokens/s of ``paratrain train --strategy single`` (subprocess) against a plain hand-written loop over
    the same model (``models.llama.build_llama``), data (python-stdlib, byte tokens), batch, seq, AdamW and
    cross-entropy, same seed. The two are interleaved (p, plain, p, plain, ...), each in its own process
    with OMP_NUM_THREADS=1, and the median of the runs is compared. Both time every optimizer step
    (paratrain's ``train_time_s`` covers the steps it ran; the plain loop times the same number of steps).

Parts (b) TP/PP communication volume, (c) the pipeline bubble and (d) memory per layout are NOT
implemented here yet (see BENCHMARKS.md); (d) at 2 ranks is covered for llama-debug by bench_plan.py.

    python benchmarks/bench_model_parallel.py [--quick] [--model llama-small] [--json [PATH]]
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
from pathlib import Path


def plain_loop(
    model_name: str, steps: int, batch: int, seq: int, max_bytes: int, lr: float, seed: int
) -> dict:
    import torch
    import torch.nn.functional as F

    from paratrain.config import DataConfig
    from paratrain.data import build_dataset
    from paratrain.models.llama import build_llama

    torch.manual_seed(seed)
    data = build_dataset(DataConfig(name="python-stdlib", seq_len=seq, max_bytes=max_bytes))
    x_all, y_all = data.train.x, data.train.y
    model = build_llama(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    n = x_all.shape[0]
    t0 = time.perf_counter()
    marks = []
    for step in range(steps):
        idx = torch.arange(step * batch, (step + 1) * batch) % n
        x, y = x_all[idx], y_all[idx]
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        marks.append(time.perf_counter() - t0)
    dt = time.perf_counter() - t0
    steady = (marks[-1] - marks[1]) / (steps - 2)  # steps 3..N, as for paratrain
    return {
        "tokens_per_s": steps * batch * seq / dt,
        "train_time_s": dt,
        "final_loss": float(loss.detach()),
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
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", metavar="PATH", nargs="?", const="benchmarks/results/model_parallel.json")
    ap.add_argument("--_plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--part", choices=["a", "b-tp", "b-pp"], default="a")
    args = ap.parse_args()
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
    runs = {"paratrain": [], "plain": []}
    loads = []
    for i in range(args.repeats):
        loads.append(os.getloadavg())
        runs["paratrain"].append(run_paratrain(args))
        runs["plain"].append(run_plain(args))
        pt, pl = runs["paratrain"][-1], runs["plain"][-1]
        print(
            f"pair {i}: all steps: paratrain {pt['tokens_per_s']:.0f} tok/s, plain {pl['tokens_per_s']:.0f}; "
            f"steps 3..N: paratrain {pt['steady_tokens_per_s']:.0f}, plain {pl['steady_tokens_per_s']:.0f}"
            f"  (paratrain loss {pt['final_loss']:.4f}, plain {pl['final_loss']:.4f})",
            flush=True,
        )
    assert runs["paratrain"][0]["num_params"] == runs["plain"][0]["num_params"]
    med_all = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    med = {k: statistics.median(r["steady_tokens_per_s"] for r in v) for k, v in runs.items()}
    ratio = med["paratrain"] / med["plain"]
    print(
        f"all steps (incl. warm-up and paratrain's MemTracker step 2): paratrain {med_all['paratrain']:.0f}, "
        f"plain {med_all['plain']:.0f}, ratio {med_all['paratrain'] / med_all['plain']:.3f}"
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
            "median_steady_tokens_per_s": med,
            "ratio_steady": ratio,
            "median_all_steps_tokens_per_s": med_all,
            "ratio_all_steps": med_all["paratrain"] / med_all["plain"],
            "load_avg": loads,
            "load_avg_end": os.getloadavg(),
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.json}")
    return 0


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


if __name__ == "__main__":
    sys.exit(main())
