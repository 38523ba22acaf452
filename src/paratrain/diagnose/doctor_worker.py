"""The processes of ``paratrain doctor``'s communication self-test.

Two entry points, one module:

- ``python -m paratrain.diagnose.doctor_worker agent --out DIR --nproc N --deadline T``: the launcher. It
  starts N ranks of this module with the real torch elastic agent
  (:func:`paratrain.launch.run_module`) and writes ``DIR/agent.json`` with the launch outcome. The doctor
  runs it as a child process in a session of its own, so that it can kill the whole job at the deadline
  whatever state the agent is in.
- ``python -m paratrain.diagnose.doctor_worker rank --out DIR --deadline T``: one rank. It writes
  ``DIR/rank<R>.json`` at the start and after every phase (``init``, ``collectives``, ``busbw``, ``p2p``,
  ``done``), so that a rank that stops is named together with the phase it stopped in. A watchdog thread
  writes a timeout record and exits the process at the deadline ``T`` (seconds since the epoch): a rank
  stuck in a collective does not outlive the doctor.

What a rank runs, in order (every rank issues the same calls in the same order):

1. every collective once, on ``int64`` tensors whose values are functions of the rank numbers, compared
   *exactly* with the result computed from those numbers (all_reduce sum and max, broadcast from the last
   rank, all_gather, reduce_scatter, all_to_all, barrier, and a send/recv ring);
2. all_reduce of float32 buffers at a few sizes, each rank timing its own calls (barrier, start, call,
   device sync), reported as algbw = S/t and busbw = algbw × 2(n−1)/n (nccl-tests, doc/PERFORMANCE.md);
3. a ping-pong between rank 0 and each other rank in turn, the others idle: the one measurement that
   separates one rank's slow link or device from the rest (in a collective, every rank waits for the
   slowest, so all ranks' times rise together).

``PARATRAIN_DOCTOR_INJECT=hang:R`` (rank R sleeps before joining, its watchdog off, so that only the
doctor's own deadline can end the job) and ``slow:R`` (rank R sleeps 50 ms in each round trip of its
ping-pong) exist to test the doctor itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SIZES = (64 << 10, 1 << 20, 8 << 20)
"""all_reduce message sizes S in bytes (float32 buffers)."""
P2P_BYTES = 1 << 20
_WARMUP, _ITERS = 2, 5


def _inject(kind: str, rank: int) -> bool:
    spec = os.environ.get("PARATRAIN_DOCTOR_INJECT", "")
    return any(part == f"{kind}:{rank}" for part in spec.split(","))


def _barrier(dev: Any) -> None:
    import torch.distributed as dist

    if dev.type == "cuda":
        dist.barrier(device_ids=[dev.index or 0])  # NCCL: say which device, or it guesses
    else:
        dist.barrier()


class _Report:
    """This rank's ``rank<R>.json``, rewritten atomically (write, then rename) after every phase."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"rank{rank}.json"
        self.data: dict[str, Any] = {"rank": rank, "pid": os.getpid(), "phase": "start", "error": None}
        self._lock = threading.Lock()
        self.write()

    def write(self, **updates: Any) -> None:
        with self._lock:
            self.data.update(updates)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)


def _watchdog(report: _Report, deadline: float) -> None:
    def fire() -> None:
        time.sleep(max(0.0, deadline - time.time()))
        phase = report.data.get("phase")
        report.write(error=f"timed out in phase {phase!r}: still waiting at the doctor's deadline")
        os._exit(124)

    threading.Thread(target=fire, name="doctor-watchdog", daemon=True).start()


# ---- 1. every collective, checked exactly ---------------------------------------------------------------


def _collective_checks(rank: int, n: int, dev: Any) -> dict[str, Callable[[], tuple[Any, Any]]]:
    """name -> a function that runs the collective and returns ``(got, expected)`` as nested lists."""
    import torch
    import torch.distributed as dist

    def t(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=dev)

    def all_reduce_sum() -> tuple[Any, Any]:
        x = torch.full((4,), rank + 1, dtype=torch.int64, device=dev)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x.tolist(), [n * (n + 1) // 2] * 4

    def all_reduce_max() -> tuple[Any, Any]:
        x = t(rank, n - 1 - rank)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x.tolist(), [n - 1, n - 1]

    def broadcast() -> tuple[Any, Any]:
        x = t(1000 + rank, rank)
        dist.broadcast(x, src=n - 1)
        return x.tolist(), [1000 + n - 1, n - 1]

    def all_gather() -> tuple[Any, Any]:
        out = [t(0, 0) for _ in range(n)]
        dist.all_gather(out, t(rank, rank * rank))
        return [o.tolist() for o in out], [[q, q * q] for q in range(n)]

    def reduce_scatter() -> tuple[Any, Any]:
        out = t(0, 0)
        dist.reduce_scatter(out, [t(rank * n + j, 1) for j in range(n)])
        return out.tolist(), [n * n * (n - 1) // 2 + n * rank, n]

    def all_to_all() -> tuple[Any, Any]:
        out = [t(0) for _ in range(n)]
        dist.all_to_all(out, [t(100 * rank + j) for j in range(n)])
        return [o.tolist() for o in out], [[100 * q + rank] for q in range(n)]

    def barrier() -> tuple[Any, Any]:
        _barrier(dev)
        return None, None

    def send_recv_ring() -> tuple[Any, Any]:
        if n == 1:
            return None, None  # nobody to talk to
        got = t(-1, -1)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, t(rank, 7), (rank + 1) % n), dist.P2POp(dist.irecv, got, (rank - 1) % n)]
        )
        for req in reqs:
            req.wait()
        return got.tolist(), [(rank - 1) % n, 7]

    checks = [all_reduce_sum, all_reduce_max, broadcast, all_gather, reduce_scatter, all_to_all, barrier]
    return {fn.__name__: fn for fn in [*checks, send_recv_ring]}


def run_collectives(rank: int, n: int, dev: Any) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name, fn in _collective_checks(rank, n, dev).items():
        try:
            got, expected = fn()
        except Exception as e:  # an op this backend lacks fails on every rank alike; go on with the rest
            results[name] = {"ok": False, "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            continue
        ok = got == expected
        results[name] = {"ok": ok, "detail": "" if ok else f"got {got}, expected {expected}"}
    return results


# ---- 2. all_reduce bandwidth, 3. ping-pong with rank 0 ----------------------------------------------------


def measure_busbw(rank: int, n: int, dev: Any, sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    from paratrain.runtime import device_synchronizer
    from paratrain.spec.cost import algbw, busbw

    sync = device_synchronizer(dev)
    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)  # zeros: repeated sums stay finite
        times = []
        for i in range(_WARMUP + _ITERS):
            _barrier(dev)
            sync()
            start = time.perf_counter()
            dist.all_reduce(x)
            sync()
            if i >= _WARMUP:
                times.append(time.perf_counter() - start)
        t = statistics.median(times)
        rows.append(
            {
                "bytes": nbytes,
                "time_s": t,
                "algbw_GBps": algbw(nbytes, t) / 1e9,
                "busbw_GBps": busbw("all_reduce", n, nbytes, t) / 1e9,
            }
        )
    return rows


def measure_p2p(rank: int, n: int, dev: Any, nbytes: int = P2P_BYTES) -> dict[str, float]:
    """One-way time (half the median round trip) of ``nbytes`` between rank 0 and each rank q, in turn.

    Returns ``{"q": seconds}`` on rank 0 (every q) and on rank q (its own pair); empty elsewhere."""
    import torch
    import torch.distributed as dist

    from paratrain.runtime import device_synchronizer

    sync = device_synchronizer(dev)
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=dev)
    slow = _inject("slow", rank)
    out: dict[str, float] = {}
    for q in range(1, n):
        _barrier(dev)
        if rank not in (0, q):
            continue
        peer = q if rank == 0 else 0
        times = []
        for i in range(_WARMUP + _ITERS):
            sync()
            start = time.perf_counter()
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                if slow:
                    time.sleep(0.05)
                dist.send(buf, peer)
            sync()
            if i >= _WARMUP:
                times.append(time.perf_counter() - start)
        out[str(q)] = statistics.median(times) / 2
    _barrier(dev)
    return out


# ---- entry points ------------------------------------------------------------------------------------------


def _rank_main(out: Path, deadline: float) -> int:
    rank = int(os.environ.get("RANK", "0"))
    report = _Report(out, rank)
    if _inject("hang", rank):
        time.sleep(max(0.0, deadline - time.time()) + 3600)  # no watchdog: the doctor must kill this one
    _watchdog(report, deadline)
    try:
        from paratrain.runtime import init, shutdown

        report.write(phase="init")
        ctx = init(timeout_s=max(1.0, deadline - time.time()), seed=None)
        n = ctx.world_size
        report.write(phase="collectives", world_size=n, backend=ctx.backend, device=str(ctx.device))
        report.write(phase="busbw", collectives=run_collectives(rank, n, ctx.device))
        report.write(phase="p2p", busbw=measure_busbw(rank, n, ctx.device))
        report.write(phase="done", p2p=measure_p2p(rank, n, ctx.device))
        shutdown()
    except Exception as e:
        message = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
        report.write(error=f"{type(e).__name__}: {message}")
        print(f"[rank {rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def _agent_main(out: Path, nproc: int, deadline: float) -> int:
    from paratrain.config import LaunchConfig
    from paratrain.errors import ConfigError
    from paratrain.launch import LaunchError, run_module

    argv = ["rank", "--out", str(out), "--deadline", repr(deadline)]
    result: dict[str, Any] = {"ok": True, "error": None, "failures": []}
    try:
        launch = LaunchConfig(nproc_per_node=nproc, timeout_s=max(1.0, deadline - time.time()))
        run_module("paratrain.diagnose.doctor_worker", argv, launch)
    except (LaunchError, ConfigError) as e:
        failures = [
            {"rank": f.rank, "exitcode": f.exitcode, "message": f.message} for f in getattr(e, "failures", [])
        ]
        result = {"ok": False, "error": str(e), "failures": failures}
    tmp = out / "agent.tmp"
    tmp.write_text(json.dumps(result))
    os.replace(tmp, out / "agent.json")
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paratrain.diagnose.doctor_worker")
    p.add_argument("mode", choices=["agent", "rank"])
    p.add_argument("--out", type=Path, required=True, help="directory for agent.json and rank<R>.json")
    p.add_argument("--deadline", type=float, required=True, help="seconds since the epoch")
    p.add_argument("--nproc", type=int, default=2, help="agent: local ranks to start")
    args = p.parse_args(argv)
    if args.mode == "agent":
        return _agent_main(args.out, args.nproc, args.deadline)
    return _rank_main(args.out, args.deadline)


if __name__ == "__main__":
    code = main()
    # A rank's report is written and its process group destroyed: skip interpreter finalization, where
    # Gloo's threads can abort the process (pytorch/pytorch#179291, as in paratrain.train.worker).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
