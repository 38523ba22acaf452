"""Checkpoint save throughput vs the disk's sequential write speed, and training time blocked per save.

    python benchmarks/bench_checkpoint.py [--size-mb 256] [--world-size 2] [--saves 3] [--dir /tmp] [--json]

In one run, on the same filesystem:
1. the disk's sequential write speed: one process writes ``size`` bytes in 8 MiB chunks and fsyncs
   (what ``dd conv=fsync`` measures);
2. synchronous saves (DCP, every rank writes its part, fsync, commit): GB/s = checkpoint bytes / save time;
3. asynchronous saves: the time training is blocked (staging to CPU) and the time until committed.
The model is a stack of square Linear layers with AdamW state (parameters + 2 moments = 3x the parameter
bytes), trained one step so the optimizer state exists; ddp replicates it, so DCP writes each tensor once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


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


def _bench_rank(root: str, size_mb: int, saves: int) -> dict[str, Any]:
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
    out: dict[str, Any] = {"layers": layers}
    for mode in ("sync", "async"):
        mgr = CheckpointManager(Path(root) / mode, ctx, keep_last=1, async_save=mode == "async")
        blocked, total = [], []
        for s in range(1, saves + 1):
            dist.barrier()
            t0 = time.perf_counter()
            mgr.save(s, model, opt, {"bench": True})
            blocked.append(time.perf_counter() - t0)
            mgr.wait()
            total.append(time.perf_counter() - t0)
        mgr.close()
        step = Path(root) / mode / f"step_{saves:08d}"
        nbytes = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
        out[mode] = {
            "blocked_s": statistics.median(blocked),
            "save_s": statistics.median(total),
            "bytes": nbytes,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=256, help="model + optimizer state in MiB (default 256)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--saves", type=int, default=3, help="saves per mode; medians are reported")
    p.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from paratrain.testing import run_distributed

    base = Path(tempfile.mkdtemp(prefix="paratrain-ckpt-bench-", dir=args.dir))
    try:
        # the disk is measured before and after the saves (3 times in all; a shared VM disk is noisy)
        disks = [disk_write_gbps(base, args.size_mb << 20) for _ in range(2)]
        r = run_distributed(
            _bench_rank, args.world_size, args=(str(base), args.size_mb, args.saves), timeout_s=600
        )[0]
        disks.append(disk_write_gbps(base, args.size_mb << 20))
        disk = statistics.median(disks)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for mode in ("sync", "async"):
        m = r[mode]
        rows.append(
            {
                "mode": mode,
                "checkpoint_mb": m["bytes"] / 2**20,
                "save_s": m["save_s"],
                "blocked_s": m["blocked_s"],
                "save_gbps": m["bytes"] / m["save_s"] / 1e9,
                "vs_disk": m["bytes"] / m["save_s"] / 1e9 / disk,
            }
        )
    result = {
        "disk_seq_write_gbps": disk,
        "disk_runs_gbps": disks,
        "world_size": args.world_size,
        "rows": rows,
        "async_blocked_vs_sync": rows[1]["blocked_s"] / rows[0]["blocked_s"],
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"disk sequential write (1 process, fsync): median {disk:.2f} GB/s of "
        f"{', '.join(f'{d:.2f}' for d in disks)}; world size {args.world_size}"
    )
    print(f"{'mode':>6} {'ckpt MiB':>9} {'save s':>8} {'blocked s':>10} {'GB/s':>6} {'vs disk':>8}")
    for row in rows:
        print(
            f"{row['mode']:>6} {row['checkpoint_mb']:>9.1f} {row['save_s']:>8.3f} {row['blocked_s']:>10.3f} "
            f"{row['save_gbps']:>6.2f} {row['vs_disk']:>7.0%}"
        )
    print(f"training blocked per save: async / sync = {result['async_blocked_vs_sync']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
