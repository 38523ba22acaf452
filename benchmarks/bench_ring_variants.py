"""Ring all-reduce schedules that were tried against the 16 MB gap, side by side with Gloo and the shipped ring.

The shipped ring (:mod:`paratrain.comm.ring`) measures 0.8-1.0x Gloo's all-reduce at 16 MB on 4 ranks (2
cores). These variants test three explanations; each is a complete all-reduce, checked against Gloo's
result before it is timed:

- ``ring-slot-sums``: the partial sums stay in the receive slots. The local piece is combined *into* the
  slot that received its partner (``slot += local``) and the next step sends from that slot, so the large
  tensor is only read during the reduce-scatter (the shipped ring writes every partial sum into the
  tensor and reads it back to send it). Tests: the reductions' memory traffic. A slot is reused only
  after the send from it completed, which needs more slots than a chunk has pieces (with fewer, waiting on
  that send could close a cycle around the ring): at 16 MB all six receives have a slot (12 MiB).
- ``ring-slot-sums-kept``: the same with its scratch allocated once, outside the timed calls. Tests: the
  page faults of a fresh 12 MiB scratch.
- ``ring-bidir``: two rings over the two halves of the tensor, one sending right and one sending left,
  one piece per chunk each (the same 24 messages of 2 MiB per call as the shipped ring's two pieces).
  Tests: whether both directions of every socket pair carry more than one does.

The calls take turns in every iteration in an order that rotates by one each iteration (each after a
barrier; an iteration's time is the slowest rank's; a run's figure is the median over ``--iters``); the
runs use separate process groups. CPU is summed over the ranks (user and system, every thread), with
minor page faults and voluntary context switches per call (``getrusage``).

    python benchmarks/bench_ring_variants.py --json                    # 16 MB, 4 ranks, 5 runs
    python benchmarks/bench_ring_variants.py --json --back-to-back 5 \\
        --out benchmarks/results/ring_variants_16mb_b2b.json             # 5 calls per sample
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._common import Peers, chunk_bounds, wait_all
from paratrain.testing import run_distributed

RESULTS = Path(__file__).resolve().parent / "results"
MB = 1 << 20
VARIANTS = ("native", "ring", "ring-slot-sums", "ring-slot-sums-kept", "ring-bidir")


def slot_sums_all_reduce(flat: torch.Tensor, p: Peers, scratch: torch.Tensor | None = None) -> None:
    """Sum all-reduce over the ring, the partial sums held in the receive slots (see the module doc).

    Pieces as the shipped ring cuts them (4 MiB, at least two per chunk from 1 MiB); every reduce-scatter
    receive has its own slot, so each is posted at the start. ``scratch``: at least that many bytes,
    reused instead of a fresh allocation.
    """
    n, r = p.size, p.rank
    bounds = chunk_bounds(flat.numel(), n)
    chunk_bytes = max(b - a for a, b in bounds) * flat.element_size()
    npieces = max(2 if chunk_bytes >= MB else 1, math.ceil(chunk_bytes / (4 * MB)))
    pieces = [[(a + x, a + y) for x, y in chunk_bounds(b - a, npieces)] for a, b in bounds]
    piece_max = max(b - a for chunk in pieces for a, b in chunk)
    nslots = (n - 1) * npieces
    if scratch is None:
        slots = torch.empty(nslots, piece_max, dtype=flat.dtype)
    else:
        nbytes = nslots * piece_max * flat.element_size()
        slots = scratch.view(-1)[:nbytes].view(flat.dtype).view(nslots, piece_max)
    right, left = (r + 1) % n, (r - 1) % n
    sends: dict[tuple[int, int], Any] = {}
    recvs: dict[tuple[int, int], Any] = {}

    def recv_piece(t: int, j: int) -> tuple[int, int]:
        return pieces[(r - t - 2) % n][j]

    def send(t: int, j: int, src: torch.Tensor) -> None:
        sends[(t, j)] = p.isend(src, right, tag=t) if src.numel() else None

    def recv(t: int, j: int, dst: torch.Tensor) -> None:
        recvs[(t, j)] = p.irecv(dst, left, tag=t) if dst.numel() else None

    def slot(t: int, j: int) -> torch.Tensor:
        a, b = recv_piece(t, j)
        return slots[t * npieces + j, : b - a]

    last = 2 * (n - 1)
    ag_posted: set[tuple[int, int]] = set()
    for t in range(n - 1):
        for j in range(npieces):
            recv(t, j, slot(t, j))
    for j in range(npieces):
        a, b = pieces[(r - 1) % n][j]
        send(0, j, flat[a:b])
    for t in range(last):
        for j in range(npieces):
            wait_all([recvs.pop((t, j))])
            a, b = recv_piece(t, j)
            if t < n - 2:
                held = slot(t, j)
                held.add_(flat[a:b])
                send(t + 1, j, held)
            elif t == n - 2:  # this rank's chunk is complete: into the tensor
                flat[a:b].add_(slot(t, j))
                send(t + 1, j, flat[a:b])
            elif t + 1 < last:  # all-gather: landed in place, pass it on
                send(t + 1, j, flat[a:b])
            for step in (t + 1, t + 2):  # all-gather receives, into place, one or two steps ahead
                if n - 1 <= step < last and (step, j) not in ag_posted:
                    ag_posted.add((step, j))
                    if step == n - 1:  # lands where step 0 sent from: that send must be done
                        wait_all([sends.pop((0, j), None)])
                    lo, hi = recv_piece(step, j)
                    recv(step, j, flat[lo:hi])
    wait_all(sends.values())


def bidir_all_reduce(flat: torch.Tensor, p: Peers) -> None:
    """Sum all-reduce as two one-piece rings over the tensor's halves, in opposite directions."""
    n, r = p.size, p.rank
    half = flat.numel() // 2
    streams = []
    for lo, hi, direction in ((0, half, 1), (half, flat.numel(), -1)):
        me = r if direction == 1 else n - 1 - r  # the left-going ring numbers the ranks backwards
        bounds = [(lo + a, lo + b) for a, b in chunk_bounds(hi - lo, n)]
        streams.append({
            "me": me, "right": (r + direction) % n, "left": (r - direction) % n, "bounds": bounds,
            "scratch": torch.empty(2, max(b - a for a, b in bounds), dtype=flat.dtype),
            "sends": {}, "recvs": {},
        })  # fmt: skip
    last = 2 * (n - 1)

    def piece(s: dict[str, Any], t: int, received: bool) -> tuple[int, int]:
        return s["bounds"][(s["me"] - t - (2 if received else 1)) % n]

    def post_recv(s: dict[str, Any], t: int, tag: int) -> None:
        a, b = piece(s, t, True)
        if t < n - 1:
            target = s["scratch"][t % 2, : b - a]
        else:
            wait_all([s["sends"].pop(t - n + 1, None)])  # this memory was sent from at step t - n + 1
            target = flat[a:b]
        s["recvs"][t] = p.irecv(target, s["left"], tag=tag) if b > a else None

    def post_send(s: dict[str, Any], t: int, tag: int) -> None:
        a, b = piece(s, t, False)
        s["sends"][t] = p.isend(flat[a:b], s["right"], tag=tag) if b > a else None

    for i, s in enumerate(streams):
        post_recv(s, 0, i)
        if last > 1:
            post_recv(s, 1, 2 + i)
        post_send(s, 0, i)
    for t in range(1, last + 1):
        for i, s in enumerate(streams):
            wait_all([s["recvs"].pop(t - 1)])
            if t - 1 < n - 1:
                a, b = piece(s, t - 1, True)
                flat[a:b].add_(s["scratch"][(t - 1) % 2, : b - a])
            if t + 1 < last:
                post_recv(s, t + 1, 2 * (t + 1) + i)
            if t < last:
                post_send(s, t, 2 * t + i)
    for s in streams:
        wait_all(s["sends"].values())


def _worker(
    nbytes: int, iters: int, warmup: int, back_to_back: int, variants: tuple[str, ...]
) -> dict[str, Any]:
    import resource

    from paratrain.comm import ring
    from paratrain.comm._common import peers

    torch.set_num_threads(1)
    p, rank = peers("bench", None), dist.get_rank()
    x = torch.zeros(nbytes // 4)
    kept = torch.empty(2 * nbytes + 256, dtype=torch.uint8)  # (n-1)/n of the tensor, plus uneven chunks
    calls = {
        "native": lambda: dist.all_reduce(x),
        "ring": lambda: ring.all_reduce(x, "sum", p),
        "ring-slot-sums": lambda: slot_sums_all_reduce(x, p),
        "ring-slot-sums-kept": lambda: slot_sums_all_reduce(x, p, kept),
        "ring-bidir": lambda: bidir_all_reduce(x, p),
    }
    calls = {k: v for k, v in calls.items() if k in variants}
    exact = {}
    for name, call in calls.items():  # integer-valued floats: every order of summation is exact
        src = (torch.arange(x.numel(), dtype=torch.float32) * (rank + 3)) % 17
        x.copy_(src)
        call()
        ref = src.clone()
        dist.all_reduce(ref)
        exact[name] = bool(torch.equal(x, ref))
    names = list(calls)
    rows: dict[str, list[list[float]]] = {k: [] for k in names}  # wall, cpu, user, sys, faults, vcsw
    for it in range(warmup + iters):
        for name in names[it % len(names) :] + names[: it % len(names)]:
            dist.barrier()
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(back_to_back):
                calls[name]()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if it >= warmup:
                rows[name].append([
                    v / back_to_back for v in (
                        wall, cpu, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime,
                        r1.ru_minflt - r0.ru_minflt, r1.ru_nvcsw - r0.ru_nvcsw,
                    )
                ])  # fmt: skip
    t = torch.tensor([rows[k] for k in names], dtype=torch.float64)  # (variant, iteration, 6)
    slowest = t[:, :, 0].clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(t)  # summed over the ranks
    native = statistics.median(slowest[names.index("native")].tolist()) if "native" in names else None
    out = {}
    for i, name in enumerate(names):
        med = statistics.median(slowest[i].tolist())
        mean = t[i].mean(dim=0).tolist()
        out[name] = {
            "exact": exact[name],
            "time_s": med,
            "vs_native": None if native is None else native / med,
            "cpu_s_all_ranks": statistics.median(t[i, :, 1].tolist()),
            "user_s_all_ranks_mean": mean[2],
            "sys_s_all_ranks_mean": mean[3],
            "minor_faults_all_ranks_mean": mean[4],
            "voluntary_switches_all_ranks_mean": mean[5],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--bytes", type=int, default=16 * MB, help="message size in bytes (default 16 MiB)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--back-to-back", type=int, default=1, metavar="K", help="K calls in a row per sample")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--json", action="store_true", help="print the JSON and write it to --out")
    ap.add_argument("--out", type=Path, default=RESULTS / "ring_variants_16mb.json")
    args = ap.parse_args()
    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SystemExit(f"unknown or no --variants {unknown}; choose from {', '.join(VARIANTS)}")
    if min(args.runs, args.iters, args.back_to_back) < 1 or args.ranks < 2 or args.bytes < 4 * args.ranks:
        raise SystemExit("--runs, --iters and --back-to-back must be at least 1, --ranks at least 2, and "
                         "--bytes at least 4 per rank")  # fmt: skip
    runs = []
    for r in range(args.runs):
        load = os.getloadavg()[0]
        res = run_distributed(
            _worker, args.ranks, args=(args.bytes, args.iters, args.warmup, args.back_to_back, variants),
            timeout_s=1800, env={"OMP_NUM_THREADS": "1"},
        )[0]  # fmt: skip
        runs.append({"load_avg_before": load, "load_avg": os.getloadavg()[0], "variants": res})
        print(
            f"run {r + 1}/{args.runs}: "
            + ", ".join(
                f"{k} {v['time_s'] * 1e3:.1f} ms"
                + ("" if v["vs_native"] is None else f" ({v['vs_native']:.2f}x)")
                + ("" if v["exact"] else " WRONG")
                for k, v in res.items()
            ),
            file=sys.stderr,
        )
    doc = {
        "ranks": args.ranks, "bytes": args.bytes, "cores": len(os.sched_getaffinity(0)), "iters": args.iters,
        "back_to_back": args.back_to_back, "unix_time": time.time(), "runs": runs,
    }  # fmt: skip
    if args.json:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1))
        print(json.dumps(doc))


if __name__ == "__main__":
    main()
