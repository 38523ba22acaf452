"""One rank of ``paratrain bench comm``: ``python -m paratrain.bench.comm_worker SPEC.json OUT.json``.

The parent (:mod:`paratrain.bench.comm`) validates the arguments, writes SPEC.json and starts N of these
under the torch elastic agent. Each rank:

1. calibrates the α–β–γ model (:func:`calibrate`): α from an 8-byte ping-pong, β from a 4 MiB ring shift
   with every rank sending at once, γ from a local ``add_``;
2. for every collective and size, runs ``warmup`` untimed then ``iters`` timed iterations, with the
   algorithms *interleaved* (iteration i runs every algorithm once), so slow phases of a noisy machine
   hit all algorithms alike and the ratios between them stay fair, in an order that rotates by one every
   iteration, so each algorithm runs in every position equally often (in a fixed order one algorithm
   always runs right after another's call, and its position cannot be told apart from its speed);
   ``shm`` first makes the calls in which it measures its own path for the size (``comm/shm/tune.py``),
   so that the timed ones take the path it settled on;
3. times each call alone: barrier, start, call, wait (CUDA events on the current stream on a GPU, a
   host clock on CPU), and takes, per iteration, the slowest rank's time (a collective is done when
   its last rank is), then the median over iterations.

Rank 0 writes OUT.json. The consistency check of :mod:`paratrain.comm` is off (``check=False``) for every
algorithm, so only the collective itself is timed.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain import comm
from paratrain.comm._common import wait_all
from paratrain.comm.shm.tune import CALLS as SHM_TUNING_CALLS
from paratrain.runtime import Context, init, record_errors, shutdown
from paratrain.spec.cost import LinkModel, algbw, bus_factor, predict

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def make_timer(device: torch.device) -> Callable[[Callable[[], Any]], float]:
    """``timer(fn) -> seconds``: CUDA events around ``fn`` on a GPU, ``perf_counter`` on CPU."""
    if device.type == "cuda":

        def cuda_timer(fn: Callable[[], Any]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return cuda_timer

    def cpu_timer(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return cpu_timer


def _median_time(
    ctx: Context, timer: Callable[[Callable[[], Any]], float], fn: Callable[[], Any], reps: int
) -> float:
    times = []
    for _ in range(reps):
        ctx.barrier()
        times.append(timer(fn))
    return statistics.median(times)


def calibrate(ctx: Context, timer: Callable[[Callable[[], Any]], float]) -> tuple[LinkModel, float]:
    """Fit α, β, γ on this machine; returns the model and the ping-pong β (for reference).

    - α: half the round trip of an 8-byte ping-pong between ranks 0 and 1.
    - β: a *ring shift* of 4 MiB, every rank sending to its right neighbour at the same time, which is
      how the ring and most steps of the other algorithms load the machine. On one host the "links"
      share the CPUs and memory bandwidth, so this β is what a collective actually sees; a lone
      ping-pong (also reported) is faster.
    - γ: a local ``add_`` of two 16 MiB buffers, per byte.

    Medians of repeats; the slowest rank's times; rank 0's values are broadcast.
    """
    dev, rank, n = ctx.device, ctx.rank, ctx.world_size
    small, big = torch.zeros(2, device=dev), torch.zeros(1 << 20, device=dev)  # 8 B and 4 MiB (float32)
    incoming = torch.empty_like(big)

    def ping_pong(t: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            if rank == 0:
                wait_all([dist.isend(t, 1)])
                wait_all([dist.irecv(t, 1)])
            elif rank == 1:
                wait_all([dist.irecv(t, 0)])
                wait_all([dist.isend(t, 0)])

        return run

    def ring_shift() -> None:
        ops = [dist.P2POp(dist.isend, big, (rank + 1) % n), dist.P2POp(dist.irecv, incoming, (rank - 1) % n)]
        wait_all(dist.batch_isend_irecv(ops))

    for fn in (ping_pong(small), ping_pong(big), ring_shift):
        fn()  # warm the connections
    t_small = _median_time(ctx, timer, ping_pong(small), 30) / 2
    t_big = _median_time(ctx, timer, ping_pong(big), 10) / 2
    t_shift = _median_time(ctx, timer, ring_shift, 10)
    a, b = torch.zeros(1 << 22, device=dev), torch.ones(1 << 22, device=dev)
    t_add = _median_time(ctx, timer, lambda: a.add_(b), 10)
    measured = [t_small, t_shift - t_small, t_add / a.nbytes, t_big - t_small]
    values = torch.tensor(measured, dtype=torch.float64, device=dev)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)  # the slowest rank (ranks 2.. ran no ping-pong: zeros)
    alpha, shift, gamma, pingpong = values.cpu().tolist()
    return LinkModel(alpha, max(shift, 0.0) / big.nbytes, gamma), max(pingpong, 0.0) / big.nbytes


def make_input(
    collective: str, nbytes: int, n: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """This rank's input for a message of S = ``nbytes`` (rounded down to whole elements per rank)."""
    item = torch.empty((), dtype=dtype).element_size()
    per_rank = max(1, nbytes // (item * n))
    numel = per_rank if collective == "all_gather" else per_rank * n  # all_gather: S is the gathered array
    return torch.zeros(numel, dtype=dtype, device=device)  # zeros: repeated in-place sums stay finite


def message_bytes(collective: str, x: torch.Tensor, n: int) -> int:
    return x.numel() * x.element_size() * (n if collective == "all_gather" else 1)


def make_call(collective: str, algorithm: str, x: torch.Tensor, op: str) -> Callable[[], Any]:
    if collective == "all_reduce":
        return lambda: comm.all_reduce(x, op, algorithm, check=False)
    if collective == "broadcast":
        return lambda: comm.broadcast(x, 0, algorithm, check=False)
    if collective == "reduce":
        return lambda: comm.reduce(x, 0, op, algorithm, check=False)
    if collective == "all_gather":
        return lambda: comm.all_gather(x, algorithm, check=False)
    if collective == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, op, algorithm, check=False)
    raise ValueError(f"cannot benchmark {collective!r}")


def shm_path_of(collective: str, x: torch.Tensor, n: int) -> str:
    """The path shm takes for this collective and input (``comm/shm/tune.py``): "direct" or "slots"
    (reduce has only the slots)."""
    from paratrain.comm import shm

    if collective == "reduce" or x.device.type != "cpu":
        return "slots"
    return shm.get_communicator().path(collective, message_bytes(collective, x, n))


def run(spec: dict[str, Any], ctx: Context) -> dict[str, Any]:
    """Measure everything in ``spec``; every rank returns the same result dict."""
    n, dtype, op = ctx.world_size, DTYPES[spec["dtype"]], spec["op"]
    timer = make_timer(ctx.device)
    model, beta_pingpong = calibrate(ctx, timer) if n > 1 else (LinkModel(0.0, 0.0, 0.0), 0.0)
    rows = []
    for collective in spec["collectives"]:
        algorithms = [a for a in spec["algorithms"] if a in comm.ALGORITHMS[collective]]
        for size in spec["sizes"]:
            x = make_input(collective, size, n, dtype, ctx.device)
            calls = {alg: make_call(collective, alg, x, op) for alg in algorithms}
            times: dict[str, list[float]] = {alg: [] for alg in algorithms}
            shm_path = None
            if "shm" in calls:  # shm measures which of its paths to take on a size's first calls: done here
                for _ in range(SHM_TUNING_CALLS):
                    ctx.barrier()
                    calls["shm"]()
                shm_path = shm_path_of(collective, x, n)
            for it in range(spec["warmup"] + spec["iters"]):
                # interleaved (every algorithm sees the same machine state), in a rotating order
                for alg in algorithms[it % len(algorithms) :] + algorithms[: it % len(algorithms)]:
                    ctx.barrier()
                    t = timer(calls[alg])
                    if it >= spec["warmup"]:
                        times[alg].append(t)
            # Per iteration, the slowest rank's time (a collective ends when its last rank does).
            table = torch.tensor([times[a] for a in algorithms], dtype=torch.float64, device=ctx.device)
            if n > 1:
                dist.all_reduce(table, op=dist.ReduceOp.MAX)
            nbytes = message_bytes(collective, x, n)
            for alg, per_iter in zip(algorithms, table.cpu().tolist(), strict=True):
                t = statistics.median(per_iter)
                bw = algbw(nbytes, t)
                rows.append(
                    {
                        "collective": collective,
                        "algorithm": alg,
                        "bytes": nbytes,
                        "count": x.numel(),
                        "time_s": t,
                        "min_s": min(per_iter),
                        "algbw_GBps": bw / 1e9,
                        "busbw_GBps": bw * bus_factor(collective, n) / 1e9,
                        "model_s": predict(collective, alg, n, nbytes, model),
                        **({"shm_path": shm_path} if alg == "shm" else {}),
                    }
                )
            del x, calls
    return {
        "world_size": n,
        "backend": ctx.backend or "none",
        "device": str(ctx.device),
        "dtype": spec["dtype"],
        "op": op,
        "iters": spec["iters"],
        "warmup": spec["warmup"],
        "cpu_bind": spec.get("cpu_bind", "none"),
        "rank0_cores": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "model": {
            "alpha_s": model.alpha,
            "beta_s_per_byte": model.beta,
            "gamma_s_per_byte": model.gamma,
            "beta_pingpong_s_per_byte": beta_pingpong,
        },
        "results": rows,
    }


@record_errors
def main(argv: list[str]) -> None:
    spec_path, out_path = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    ctx = init(backend=spec["backend"], device=spec["device"], timeout_s=spec["timeout_s"], seed=0)
    torch.set_num_threads(1)
    try:
        result = run(spec, ctx)
        if ctx.is_main:
            tmp = out_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            os.replace(tmp, out_path)
    finally:
        shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
