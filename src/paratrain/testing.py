"""Run a function on N local ranks (Gloo), collect every rank's return value; used by the test suite.

    results = run_distributed(fn, world_size=2, args=(x,), timeout_s=60)

Each rank is a fresh process forked from a *forkserver* that has already imported torch, its distributed
packages (DTensor, FSDP2, DCP, pipelining) and paratrain's strategies, trainer, data and models
(:data:`PRELOAD`), so a 4-rank test starts in well under a second instead of paying those imports (several
seconds of CPU) on every rank of every test. Rendezvous is a FileStore in a
temporary directory (no TCP port to collide with). ``fn`` must be importable (a module-level function).
The process group exists when ``fn`` runs and is destroyed afterwards; a rank that raises fails the
whole call with that rank's traceback; a call that outlives ``timeout_s`` kills every rank and raises
:class:`TimeoutError` instead of hanging the test run.

Kill tests, whose ranks must die or skip the teardown, use :func:`run_processes` (bare processes, exit
codes back) with :func:`call_until_the_last_rank_dies` as the end of each rank's function.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

_CTX: Any = None

# Imported once by the forkserver, inherited by every rank it forks. None of them reads the environment at
# import time (the ranks' variables are set after the fork); a module that cannot be imported is skipped.
PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "transformers.models.llama.modeling_llama",  # the Hugging Face families the tests build
    "transformers.models.gpt2.modeling_gpt2",
    "paratrain.parallel",
    "paratrain.train.trainer",
    "paratrain.checkpoint",
    "paratrain.data",
    "paratrain.models",
]


def _context() -> Any:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _CTX = ctx
    return _CTX


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    env: Mapping[str, str],
    backend: str,
    timeout_s: float,
    out: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "OMP_NUM_THREADS": "1",
        }
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        out.put((rank, "ok", buf.getvalue()))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 60.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return the results in rank order."""
    import torch

    ctx = _context()
    out = ctx.Queue()
    env = dict(env or {})
    env.setdefault("MASTER_PORT", str(free_port()))
    with tempfile.TemporaryDirectory(prefix="paratrain-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    r,
                    world_size,
                    init_file,
                    tuple(args),
                    dict(kwargs or {}),
                    env,
                    backend,
                    timeout_s,
                    out,
                ),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(results) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise TimeoutError(
                        f"run_distributed({getattr(fn, '__name__', fn)}): ranks {missing} did not finish "
                        f"within {timeout_s:.0f}s (a hang or a deadlock)"
                    )
                try:
                    rank, status, payload = out.get(timeout=min(remaining, 0.5))
                except queue.Empty:
                    dead = [
                        r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results
                    ]
                    if dead:
                        raise RuntimeError(
                            f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before returning"
                        ) from None
                    continue
                if status == "error":
                    raise RuntimeError(f"rank {rank} raised:\n{payload}")
                results[rank] = torch.load(
                    io.BytesIO(payload), weights_only=False
                )  # paratrain: ignore[unsafe-torch-load]  (our own child processes)
        finally:
            for p in procs:
                p.join(timeout=5 if len(results) == world_size else 0.1)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            out.close()
    return [results[r] for r in range(world_size)]


def run_processes(
    target: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout_s: float = 60.0
) -> list[int | None]:
    """Run ``target(rank, world_size, *args)`` in ``world_size`` bare processes; their exit codes.

    For tests that kill a rank or must skip the harness's process-group teardown: the target sets up its
    own process group and reports through files. A process still alive after ``timeout_s`` is killed.
    """
    ctx = _context()
    procs = [ctx.Process(target=target, args=(r, world_size, *args), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return [p.exitcode for p in procs]


def call_until_the_last_rank_dies(
    call: Callable[[], Any], rank: int, world_size: int, report: dict[str, Any], outdir: str
) -> NoReturn:
    """The body of a kill test's rank (under :func:`run_processes`): the last rank SIGKILLs itself 0.3 s
    from now, mid-loop; every rank calls ``call()`` until it raises. ``report`` gets ``error`` and
    ``elapsed`` (seconds from the kill's arming to the error) and is written to ``outdir/<rank>.json``,
    also once before the loop. The process then exits at once, skipping the process-group teardown with
    a dead peer."""
    Path(outdir, f"{rank}.json").write_text(json.dumps(report))
    if rank == world_size - 1:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        while True:
            call()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
    report["elapsed"] = time.monotonic() - start
    Path(outdir, f"{rank}.json").write_text(json.dumps(report))
    os._exit(0)
