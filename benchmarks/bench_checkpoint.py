"""Checkpoint save throughput with and without checksums, vs the disk's write speed; time blocked per async save.

    python benchmarks/bench_checkpoint.py [--size-mb 256] [--world-size 2] [--rounds 5] [--dir /tmp] [--json]
                                          [--out benchmarks/results/checkpoint_hash.json] [--no-async]

In one run, on the same filesystem:
1. the disk's sequential write speed: one process writes ``size`` bytes in 8 MiB chunks and fsyncs
   (what ``dd conv=fsync`` measures), before and after the saves;
2. synchronous saves, **checksummed** (paratrain's :class:`HashingWriter`: every file hashed while written)
   and **unhashed** (DCP's own ``FileSystemWriter`` file system, as before checksums; the manifest gets
   sizes from ``stat``), interleaved: round ``i`` runs one save of each, alternating which goes first, so
   that drift of a shared machine hits both alike. GB/s = checkpoint bytes / save time (every rank writes
   its part, fsync, commit). Reported: the median of each, and per round the ratio hashed/unhashed
   throughput (median and spread: that spread is the noise of the comparison);
3. (unless ``--no-async``) asynchronous saves with checksums: time training is blocked, time to commit.
The model is a stack of square Linear layers with AdamW state (parameters + 2 moments = 3x the parameter
bytes), trained one step so the optimizer state exists; ddp replicates it, so DCP writes each tensor once.
Raw results go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results" / "checkpoint_hash.json"


def disk_write_gbps(directory: Path, nbytes: int) -> float:
    path = directory / "seqwrite.bin"
    chunk = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(chunk))):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    written = path.stat().st_size
    path.unlink()
    return written / dt / 1e9


def _unhashed_writer() -> Any:
    """The baseline: DCP's plain file system (no stream wrapper, no hashing); sizes from ``stat`` after the
    write, with a placeholder digest, so the manager's commit path is the same as with checksums."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    from paratrain.checkpoint.integrity import FileDigest, HashingWriter, _DigestReport

    class Unhashed(HashingWriter):
        def __init__(self, path: Any, **kw: Any) -> None:
            super().__init__(path, **kw)
            self.fs = FileSystem()

        def _sizes(self, names: list[str]) -> dict[str, FileDigest]:
            return {n: FileDigest((Path(self.path) / n).stat().st_size, "-") for n in names}

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = FileSystemWriter.write_data(self, plan, planner)
            fut.wait()
            mine = [p.name for p in Path(self.path).glob(f"{plan.storage_data.prefix}*.distcp")]
            report = _DigestReport(self.hash_rank, {**self.extra, **self._sizes(mine)})
            fut.value().append(report)
            return fut

        def finish(self, metadata: Any, results: Any) -> None:
            digests: dict[str, FileDigest] = {}
            for rank_results in results:
                for r in [r for r in rank_results if isinstance(r, _DigestReport)]:
                    digests.update(r.digests)
                    rank_results.remove(r)
            FileSystemWriter.finish(self, metadata, results)
            self.all_digests = {**digests, **self._sizes([".metadata"])}

    return Unhashed


def _bench_rank(
    root: str, size_mb: int, rounds: int, with_async: bool, algorithm: str | None
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.checkpoint.manager import CheckpointManager
    from paratrain.runtime import init

    ctx = init("gloo", "cpu", 300.0, 0)
    width = 1024
    layers = max(1, size_mb * (1 << 20) // 3 // (width * width * 4))
    model = DDP(nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    managers = {
        "hashed": CheckpointManager(Path(root) / "hashed", ctx, keep_last=1, checksum_algorithm=algorithm),
        "unhashed": CheckpointManager(
            Path(root) / "unhashed", ctx, keep_last=1, writer_factory=_unhashed_writer()
        ),
    }
    times: dict[str, list[float]] = {"hashed": [], "unhashed": []}
    cpu: dict[str, list[float]] = {"hashed": [], "unhashed": []}
    for step in range(1, rounds + 2):  # round 0 warms up both (first-touch allocations, page cache)
        order = ["hashed", "unhashed"] if step % 2 else ["unhashed", "hashed"]
        for mode in order:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            managers[mode].save(step, model, opt, {"bench": True})
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if step > 1:
                times[mode].append(dt)
                cpu[mode].append(dc)
    nbytes = {
        mode: sum(
            f.stat().st_size for f in (Path(root) / mode / f"step_{rounds + 1:08d}").rglob("*") if f.is_file()
        )
        for mode in managers
    }
    out: dict[str, Any] = {
        "layers": layers,
        "sync_s": times,
        "cpu_s": cpu,
        "bytes": nbytes,
        "algorithm": managers["hashed"].checksum_algorithm,
    }
    if with_async:
        mgr = CheckpointManager(
            Path(root) / "async", ctx, keep_last=1, async_save=True, checksum_algorithm=algorithm
        )
        blocked, total = [], []
        for s in range(1, rounds + 1):
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(s, model, opt, {"bench": True})
            blocked.append(time.perf_counter() - t0)
            mgr.wait()
            total.append(time.perf_counter() - t0)
        mgr.close()
        out["async"] = {"blocked_s": statistics.median(blocked), "save_s": statistics.median(total)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256, help="model + optimizer state in MiB (default 256)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (one save of each kind); >= 5")
    p.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)")
    p.add_argument("--out", default=str(RESULTS), help="where to store the raw JSON ('' for nowhere)")
    p.add_argument("--no-async", action="store_true", help="skip the async measurement")
    p.add_argument(
        "--algorithm",
        default=None,
        help="checksum algorithm (crc32, xxh3-128, blake2b-128; default: paratrain's)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from paratrain.testing import run_distributed

    base = Path(tempfile.mkdtemp(prefix="paratrain-ckpt-bench-", dir=args.dir))
    try:
        disks = [disk_write_gbps(base, args.size_mb << 20) for _ in range(2)]
        ranks = run_distributed(
            _bench_rank,
            args.world_size,
            args=(str(base), args.size_mb, args.rounds, not args.no_async, args.algorithm),
            timeout_s=600,
        )
        r = ranks[0]
        disks.append(disk_write_gbps(base, args.size_mb << 20))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    disk = statistics.median(disks)
    gbps = {m: [r["bytes"][m] / t / 1e9 for t in r["sync_s"][m]] for m in ("hashed", "unhashed")}
    ratios = [h / u for h, u in zip(gbps["hashed"], gbps["unhashed"], strict=True)]
    # CPU seconds of one save, summed over ranks: the work hashing adds, much less noisy than wall time on a
    # shared machine (there, a CPU second can cost several wall seconds)
    cpu = {
        m: [sum(x["cpu_s"][m][i] for x in ranks) for i in range(args.rounds)] for m in ("hashed", "unhashed")
    }
    result: dict[str, Any] = {
        "command": "python benchmarks/bench_checkpoint.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "world_size": args.world_size,
        "algorithm": r["algorithm"],
        "checkpoint_mb": r["bytes"]["hashed"] / 2**20,
        "rounds": args.rounds,
        "disk_seq_write_gbps": disk,
        "disk_runs_gbps": disks,
        "sync_s": r["sync_s"],
        "sync_gbps": gbps,
        "hashed_gbps_median": statistics.median(gbps["hashed"]),
        "unhashed_gbps_median": statistics.median(gbps["unhashed"]),
        "ratio_per_round": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "cpu_s": cpu,
        "cpu_ratio_median": statistics.median(cpu["hashed"]) / statistics.median(cpu["unhashed"]),
        "async": r.get("async"),
        "cpu_count": os.cpu_count(),
        "load_avg": os.getloadavg(),
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"disk sequential write (1 process, fsync): median {disk:.2f} GB/s of "
        f"{', '.join(f'{d:.2f}' for d in disks)}; world size {args.world_size}; "
        f"checkpoint {result['checkpoint_mb']:.1f} MiB; {args.rounds} interleaved rounds; checksums: {r['algorithm']}"
    )
    print(f"{'sync save':>10} {'median s':>9} {'GB/s':>6} {'vs disk':>8} {'CPU s':>6}  per round GB/s")
    for mode in ("unhashed", "hashed"):
        g = statistics.median(gbps[mode])
        print(
            f"{mode:>10} {statistics.median(r['sync_s'][mode]):>9.3f} {g:>6.2f} {g / disk:>7.0%} "
            f"{statistics.median(cpu[mode]):>6.3f}  " + " ".join(f"{v:.2f}" for v in gbps[mode])
        )
    print(
        f"throughput with checksums / without: median {result['ratio_median']:.3f} "
        f"(per round {result['ratio_min']:.3f} .. {result['ratio_max']:.3f}); "
        f"CPU seconds per save with / without: {result['cpu_ratio_median']:.3f}"
    )
    if r.get("async"):
        a = r["async"]
        print(f"async (checksummed): blocked {a['blocked_s']:.3f} s, until committed {a['save_s']:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
