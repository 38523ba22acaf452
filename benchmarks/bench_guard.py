"""What ``launch --guard`` costs: step time of a small DDP script with and without the guard.

The workload: a torchrun-style DDP script, 2 Gloo ranks, MLP 784-256-256-10, batch 64 per rank, SGD, and one
``dist.all_reduce`` of the loss per step (as scripts do for logging).

1. **in the same processes** (the figure to quote): under ``paratrain launch``, each worker alternates
   blocks of ``--block`` steps without and with the guard installed (``Guard.install`` / ``uninstall``, a
   guard directory, the model remembered, and on rank 0 a :class:`GuardMonitor` thread polling both ranks'
   records as the launcher does), for ``--rounds`` rounds in alternating order, each block timed between
   barriers. With ``--block 100`` and the default ``--check-desync-every 100`` every guarded block contains
   exactly one desync check, so its cost is amortized as in a real run. Reported: the median over rounds of
   the per-round ratio guarded/plain, for wall time and CPU time. Noise on a busy machine hits both alike.
2. **end to end**: ``paratrain launch`` against ``launch --guard`` as separate jobs, interleaved, ``--runs``
   each; the mean step time over ``--steps`` steps after a warm-up, median over runs. Job-to-job noise on a
   shared machine is larger than the guard's cost; shown for completeness.
3. **the parts** (one process, CPU time, interleaved): microseconds per ``dist.all_reduce`` with and
   without the recorder, the recording alone, a progress tick (per forward and per optimizer step), the
   desync digests of the whole model, and the workload's step; ``estimated_overhead_pct`` adds the parts up
   for one step at K = 100 (one collective, two ticks, 1/100 of a digest pass) over the step's CPU time.
   This is the steadiest figure on a busy machine, where 1. and 2. swing by several percent from run to run.

    python benchmarks/bench_guard.py                # tables
    python benchmarks/bench_guard.py --json         # also writes benchmarks/results/guard.json
    python benchmarks/bench_guard.py --runs 1 --rounds 4    # a quick look
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
from typing import Any

SCRIPT = """
import json, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank, steps, warmup = dist.get_rank(), int(sys.argv[2]), 30
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
xs = [torch.randn(64, 784, generator=gen) for _ in range(8)]
ys = [torch.randint(0, 10, (64,), generator=gen) for _ in range(8)]
for step in range(warmup + steps):
    if step == warmup:
        dist.barrier()
        wall, cpu = time.perf_counter(), time.process_time()
    loss = torch.nn.functional.cross_entropy(model(xs[step % 8]), ys[step % 8])
    opt.zero_grad()
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    dist.all_reduce(logged)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
t = torch.tensor([wall, cpu], dtype=torch.float64)
dist.all_reduce(t)
if rank == 0:
    world = dist.get_world_size()
    out = {"wall_ms_per_step": 1e3 * t[0].item() / world / steps, "cpu_ms_per_step": 1e3 * t[1].item() / steps}
    open(sys.argv[1], "w").write(json.dumps(out))
dist.destroy_process_group()
"""


AB_SCRIPT = """
import json, os, sys, tempfile, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from paratrain.diagnose.guard.hooks import Guard
from paratrain.diagnose.guard.launcher import GuardMonitor
dist.init_process_group("gloo")
rank, rounds, block = dist.get_rank(), int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
xs = [torch.randn(64, 784, generator=gen) for _ in range(8)]
ys = [torch.randint(0, 10, (64,), generator=gen) for _ in range(8)]
guard_dir = [tempfile.mkdtemp(prefix="bench-guard-") if rank == 0 else None]
dist.broadcast_object_list(guard_dir, src=0)

def steps(n):
    for step in range(n):
        loss = torch.nn.functional.cross_entropy(model(xs[step % 8]), ys[step % 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)

def timed(guarded):
    guard = monitor = None
    if guarded:
        guard = Guard(guard_dir[0], 300.0, 100, store_mode=False)
        guard.install()
        guard.remember(model)
        if rank == 0:
            monitor = GuardMonitor(guard_dir[0], 300.0).__enter__()
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    steps(block)
    dist.barrier()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if guard is not None:
        guard.uninstall()
    if monitor is not None:
        monitor._stop.set()
    t = torch.tensor([wall, cpu], dtype=torch.float64)
    dist.all_reduce(t)
    return t[0].item() / dist.get_world_size() / block, t[1].item() / block

steps(30)  # warm-up
ratios = {"wall": [], "cpu": []}
blocks = {"plain": [], "guarded": []}
for r in range(rounds):
    order = (False, True) if r % 2 == 0 else (True, False)
    got = {g: timed(g) for g in order}
    blocks["plain"].append(got[False])
    blocks["guarded"].append(got[True])
    ratios["wall"].append(got[True][0] / got[False][0])
    ratios["cpu"].append(got[True][1] / got[False][1])
if rank == 0:
    open(sys.argv[1], "w").write(json.dumps({"ratios": ratios, "blocks_s_per_step": blocks}))
dist.barrier()
if rank == 0:
    import shutil
    shutil.rmtree(guard_dir[0], ignore_errors=True)
dist.destroy_process_group()
"""


def same_processes(rounds: int, block: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-guard-") as name:
        tmp = Path(name)
        script = tmp / "ab.py"
        script.write_text(AB_SCRIPT)
        out = tmp / "ab.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", "2", str(script)]
        subprocess.run([*cmd, str(out), str(rounds), str(block)], check=True, env=env, capture_output=True)
        raw = json.loads(out.read_text())
    result: dict[str, Any] = {"rounds": rounds, "block_steps": block, "check_desync_every": 100}
    for key in ("wall", "cpu"):
        result[f"{key}_overhead_pct"] = 100 * (statistics.median(raw["ratios"][key]) - 1)
    for name in ("plain", "guarded"):
        result[f"{name}_wall_ms_per_step"] = 1e3 * statistics.median(
            b[0] for b in raw["blocks_s_per_step"][name]
        )
        result[f"{name}_cpu_ms_per_step"] = 1e3 * statistics.median(
            b[1] for b in raw["blocks_s_per_step"][name]
        )
    result["raw"] = raw
    return result


def parts(calls: int) -> dict[str, float]:
    """CPU µs per all_reduce without and with the recorder (world size 1, Gloo, FileStore rendezvous), and
    the recording alone (enter + exit of a cached call site, no collective). CPU time, not wall time: on a
    busy machine the wall clock mostly measures the wait for a core."""
    import torch
    import torch.distributed as dist

    from paratrain.diagnose.guard.desync import named_state, tensor_digest
    from paratrain.diagnose.guard.record import RecordWriter
    from paratrain.diagnose.guard.recorder import OPS, Recorder, _Spec

    holder = tempfile.TemporaryDirectory(prefix="bench-guard-")
    tmp = holder.name
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    t = torch.ones(4)
    recorder = Recorder(RecordWriter(os.path.join(tmp, "rank0.rec"), 0, 1))

    def timed() -> float:
        start = time.process_time()
        for _ in range(calls):
            dist.all_reduce(t)
        return 1e6 * (time.process_time() - start) / calls

    def record_only() -> float:
        spec = _Spec(
            "all_reduce", (0, "tensor"), [(1, "op", dist.ReduceOp.SUM)], (2, "group"), (3, "async_op")
        )
        start = time.process_time()
        for _ in range(calls):
            recorder.exit(recorder.enter(spec, (t,), {}), True)
        return 1e6 * (time.process_time() - start) / calls

    def tick() -> float:
        start = time.process_time()
        for _ in range(calls):
            recorder.writer.tick()
        return 1e6 * (time.process_time() - start) / calls

    model = _bench_model(torch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def step_ms() -> float:  # the workload's step in one process, for scale
        start = time.process_time()
        for _ in range(50):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return 1e3 * (time.process_time() - start) / 50

    def digest_ms() -> float:  # the desync check's local part: digests of every parameter
        named = named_state(model)
        start = time.process_time()
        for _ in range(10):
            torch.stack([tensor_digest(p) for _, p in named])
        return 1e3 * (time.process_time() - start) / 10

    assert "all_reduce" in OPS
    runs: dict[str, list[float]] = {k: [] for k in ("plain", "guarded", "alone", "tick", "step", "digest")}
    for _ in range(5):  # interleaved
        runs["plain"].append(timed())
        recorder.install()
        runs["guarded"].append(timed())
        recorder.uninstall()
        runs["alone"].append(record_only())
        runs["tick"].append(tick())
        runs["step"].append(step_ms())
        runs["digest"].append(digest_ms())
    dist.destroy_process_group()
    recorder.writer.close()
    holder.cleanup()
    m = {k: statistics.median(v) for k, v in runs.items()}
    # per step of the workload: one recorded collective, two progress ticks (forward, optimizer step),
    # and a desync check every 100 steps (its all_gather of 3 x 8 bytes per tensor is not counted)
    per_step_us = max(m["guarded"] - m["plain"], m["alone"]) + 2 * m["tick"] + 1e3 * m["digest"] / 100
    return {
        "plain_cpu_us": m["plain"],
        "guarded_cpu_us": m["guarded"],
        "overhead_cpu_us": m["guarded"] - m["plain"],
        "record_only_cpu_us": m["alone"],
        "tick_cpu_us": m["tick"],
        "digest_cpu_ms": m["digest"],
        "step_cpu_ms": m["step"],
        "estimated_overhead_pct": 100 * per_step_us / (1e3 * m["step"]),
    }


def _bench_model(torch: Any) -> Any:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 10))


def _run(guarded: bool, script: Path, steps: int, out: Path) -> dict[str, float]:
    if guarded:
        cmd = [sys.executable, "-m", "paratrain.diagnose.guard.run", "--nproc-per-node", "2"]
    else:
        cmd = [sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*cmd, str(script), str(out), str(steps)], check=True, env=env, capture_output=True)
    return dict(json.loads(out.read_text()))


def training_step(runs: int, steps: int) -> dict[str, Any]:
    plain: list[dict[str, float]] = []
    guarded: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="bench-guard-") as name:
        tmp = Path(name)
        script = tmp / "ddp_script.py"
        script.write_text(SCRIPT)
        for i in range(runs):
            plain.append(_run(False, script, steps, tmp / f"plain{i}.json"))
            guarded.append(_run(True, script, steps, tmp / f"guarded{i}.json"))
    result: dict[str, Any] = {"runs": runs, "steps": steps, "check_desync_every": 100}
    for key in ("wall_ms_per_step", "cpu_ms_per_step"):
        p = statistics.median(r[key] for r in plain)
        g = statistics.median(r[key] for r in guarded)
        result[key] = {"plain": p, "guarded": g, "overhead_pct": 100 * (g / p - 1)}
    result["raw"] = {"plain": plain, "guarded": guarded}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="interleaved runs of each (default 3)")
    p.add_argument("--steps", type=int, default=500, help="timed steps per run (default 500)")
    p.add_argument("--calls", type=int, default=2000, help="all_reduce calls per timing (default 2000)")
    p.add_argument("--json", action="store_true", help="print JSON and write benchmarks/results/guard.json")
    p.add_argument("--parts-only", action="store_true", help="only the parts (3.)")
    p.add_argument("--rounds", type=int, default=10, help="same-process A/B rounds (default 10)")
    p.add_argument("--block", type=int, default=100, help="steps per A/B block (default 100)")
    args = p.parse_args()
    result: dict[str, Any] = {"parts": parts(args.calls)}
    if args.parts_only:
        print(json.dumps(result))
        return
    result["same_processes"] = same_processes(args.rounds, args.block)
    result["training_step"] = training_step(args.runs, args.steps)
    result["machine"] = {"cpus": os.cpu_count(), "load_avg": os.getloadavg()[0]}
    if args.json:
        path = Path(__file__).resolve().parent / "results" / "guard.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result))
        return
    c, s, ab = result["parts"], result["training_step"], result["same_processes"]
    print(f"same processes, {ab['rounds']} rounds x {ab['block_steps']} steps, desync check every 100 steps:")
    print(f"  plain {ab['plain_wall_ms_per_step']:.3f} ms/step, guarded {ab['guarded_wall_ms_per_step']:.3f} ms/step; "
          f"median per-round overhead: wall {ab['wall_overhead_pct']:+.1f}%, cpu {ab['cpu_overhead_pct']:+.1f}%")  # fmt: skip
    print(f"parts: record {c['record_only_cpu_us']:.1f} us/collective, tick {c['tick_cpu_us']:.1f} us, digests "
          f"{c['digest_cpu_ms']:.2f} ms/check, step {c['step_cpu_ms']:.2f} ms -> estimated "
          f"{c['estimated_overhead_pct']:.2f}% at K=100")  # fmt: skip
    print(f"one all_reduce (world 1, gloo), CPU time: {c['plain_cpu_us']:.1f} us plain, {c['guarded_cpu_us']:.1f} us "
          f"recorded (+{c['overhead_cpu_us']:.1f} us); recording alone {c['record_only_cpu_us']:.1f} us")  # fmt: skip
    print(f"DDP step, 2 ranks, {s['steps']} steps x {s['runs']} interleaved runs, --check-desync-every 100:")
    for key, label in (("wall_ms_per_step", "wall"), ("cpu_ms_per_step", "cpu (sum of ranks)")):
        r = s[key]
        print(
            f"  {label:20s} {r['plain']:.3f} ms plain, {r['guarded']:.3f} ms guarded ({r['overhead_pct']:+.1f}%)"
        )


if __name__ == "__main__":
    main()
