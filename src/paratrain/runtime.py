"""Process runtime: the torchrun environment, backend and device choice, seeding, rank-0 output.

``init()`` is the first thing a worker calls. It reads the environment the elastic agent sets (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), pins the CUDA device from LOCAL_RANK *before* any
CUDA work (otherwise every rank would allocate a context on GPU 0), creates the process group with a
timeout, and seeds every RNG identically. With no torchrun environment it is a world of size 1 and
creates no process group, so the same training code runs in a notebook.

Reference: https://pytorch.org/docs/stable/distributed.html#initialization
"""

from __future__ import annotations

import atexit
import datetime
import functools
import json
import logging
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from paratrain.errors import permanent_reason

log = logging.getLogger("paratrain")


@dataclass(frozen=True)
class Context:
    """Who this process is in the job. Passed explicitly; paratrain keeps no global process-group state."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None
    """``gloo`` / ``nccl``, or ``None`` when no process group exists (world size 1 without torchrun)."""
    timeout_s: float
    restart_count: int = 0
    """How many times the worker group was started before this one, the same on every node
    (:func:`attempt`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None and dist.is_initialized()

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op on CPU): the one place device sync is called."""
        synchronize(self.device)

    def barrier(self) -> None:
        if self.distributed:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index or 0])
            else:
                dist.barrier()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def choose_backend(backend: str = "auto", device: str = "auto") -> tuple[str, str]:
    """Resolve ``(backend, device_type)``: NCCL+CUDA when CUDA is present, else Gloo+CPU."""
    if device == "auto":
        device = "cuda" if cuda_available() else "cpu"
    if device == "cuda" and not cuda_available():
        raise RuntimeError("device 'cuda' was requested but no CUDA GPU is visible. Use --device cpu.")
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise RuntimeError("backend 'nccl' needs CUDA devices. Use --backend gloo on CPU.")
    return backend, device


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with the same value."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)  # also seeds all CUDA devices


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def attempt() -> int:
    """Which start of the worker group this is (0: the first), the same on every node.

    torch's ``TORCHELASTIC_RESTART_COUNT`` is counted by each agent: when one node's worker dies, that
    agent counts a restart and the others, restarting for the membership change, do not (pytorch#135712),
    so it cannot name an attempt across nodes. Under ``paratrain launch`` the rendezvous wrapper
    (:class:`paratrain.launch.signals.GuardedRendezvous`) publishes the round's first agent's count to all
    of them (``PARATRAIN_ATTEMPT``); otherwise the per-agent count is all there is."""
    return _env_int("PARATRAIN_ATTEMPT", _env_int("TORCHELASTIC_RESTART_COUNT", 0))


def attempt_key() -> str:
    """A store-key prefix unique to this start of the worker group and the same on every node: the
    rendezvous round's token under ``paratrain launch`` (``PARATRAIN_ROUND_KEY``), else :func:`attempt`."""
    return os.environ.get("PARATRAIN_ROUND_KEY") or str(attempt())


def init(
    backend: str = "auto",
    device: str = "auto",
    timeout_s: float = 300.0,
    seed: int | None = 0,
) -> Context:
    """Initialise this worker and return its :class:`Context`.

    Args:
        backend: ``auto`` (NCCL with CUDA, Gloo otherwise), ``gloo`` or ``nccl``.
        device: ``auto``, ``cpu`` or ``cuda``.
        timeout_s: process-group timeout; a collective that waits longer fails instead of hanging.
        seed: seed for every RNG, identical on all ranks (``None`` leaves the RNGs alone).
    """
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 1)
    backend, device_type = choose_backend(backend, device)
    if device_type == "cuda":
        # Pin the device first: any CUDA call before this would create a context on GPU 0 for every rank.
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} GPU(s) are visible: "
                "start at most one process per GPU (--nproc-per-node)."
            )
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")

    use_pg = "MASTER_ADDR" in os.environ and world_size >= 1 and "RANK" in os.environ
    if use_pg and not dist.is_initialized():
        install_exit_grace()
        kwargs: dict[str, Any] = {
            "backend": backend,
            "timeout": datetime.timedelta(seconds=timeout_s),
            "rank": rank,
            "world_size": world_size,
        }
        if device_type == "cuda":
            kwargs["device_id"] = dev  # eager NCCL init bound to this device
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The agent's store outlives a restart of the worker group, and torch uses it without a
            # per-attempt prefix: a restarted rank would read its peers' addresses from the failed attempt
            # and fail to connect. Prefix every key with this attempt's key, the same on every node.
            client = _connect_agent_store(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, timeout_s
            )
            kwargs["store"] = dist.PrefixStore(f"paratrain/attempt_{attempt_key()}", client)
        dist.init_process_group(**kwargs)
    if seed is not None:
        seed_everything(seed)
    return Context(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=dev,
        backend=backend if dist.is_initialized() else None,
        timeout_s=timeout_s,
        restart_count=attempt(),
    )


def die_with_launcher() -> None:
    """Make this worker exit when the process that launched it dies, however it dies.

    The torch elastic agent starts every worker in a session of its own, so a SIGKILL of the launcher's
    process group (an OOM killer, a scheduler, a closed terminal) would leave the workers training on,
    writing checkpoints into a directory the next run is already using. ``paratrain launch`` starts every
    worker through ``paratrain/launch/boot.py``, which does this before the interpreter imports anything;
    this call repeats it for workers started otherwise. On Linux the kernel delivers SIGKILL to this process
    when its parent dies (``prctl(PR_SET_PDEATHSIG)``); then, if the parent is no longer the launcher
    (``PARATRAIN_LAUNCHER_PID``), the launcher died before that and this exits now. The store connection
    (:func:`init`) and the heartbeat thread (:mod:`paratrain.train.faults`) back this up on every platform.
    """
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            pr_set_pdeathsig = 1
            libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        except OSError:  # not glibc: the store connection and the heartbeat still cover it
            pass
    if launcher_gone():
        print(f"[paratrain] rank {os.environ.get('RANK', '?')}: the launcher is gone; exiting",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(1)


def launcher_gone() -> bool:
    """Whether paratrain's launcher of this worker has died: this process's parent is no longer the pid the
    launcher recorded (``PARATRAIN_LAUNCHER_PID``). The kernel re-parents a process as its parent exits,
    before that parent is reaped, so this is exact where ``kill(pid, 0)`` is not (a zombie answers it).
    ``False`` when no paratrain launcher started this process."""
    launcher = _env_int("PARATRAIN_LAUNCHER_PID", 0)
    return launcher > 0 and os.getppid() != launcher


STORE_TRY_S = 3.0
"""How long one attempt to connect to the launcher's store lasts; between attempts a worker checks that its
launcher is alive, so a worker never waits longer than this for a dead one."""


def _connect_agent_store(host: str, port: int, world_size: int, timeout_s: float) -> Any:
    """A client of the elastic agent's store, connected in attempts of ``STORE_TRY_S`` seconds up to
    ``timeout_s`` in all; exits the process as soon as the launcher is found gone between attempts."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            client = dist.TCPStore(
                host,
                port,
                world_size,
                is_master=False,
                timeout=datetime.timedelta(seconds=max(0.1, min(STORE_TRY_S, left))),
            )
        except (RuntimeError, OSError):
            die_with_launcher()
            if time.monotonic() >= deadline:
                raise
            continue
        client.set_timeout(datetime.timedelta(seconds=timeout_s))
        return client


EXIT_GRACE_S = 0.1
"""How long the exit grace (:func:`install_exit_grace`) sleeps before interpreter finalization."""

_exit_grace_installed = False


def install_exit_grace() -> None:
    """Make this process sleep ``EXIT_GRACE_S`` at exit, just before interpreter finalization. Idempotent.

    Why: a Gloo worker thread drops its reference to a collective after the caller saw it finish. When
    that reference is the last one and the collective's tensor wraps a Python object (the pickled bytes
    of ``broadcast_object_list`` / ``all_gather_object``, any ``torch.frombuffer`` tensor), freeing it
    takes the GIL. The thread outlives ``destroy_process_group`` whenever something still holds the
    group (a DDP model, a DeviceMesh). If the main thread reaches interpreter finalization first, Python
    3.11 ends the waiting thread with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor
    calls ``std::terminate``: the rank dies with SIGABRT ("terminate called without an active
    exception") after the script succeeded. The sleep releases the GIL so the thread finishes first.

    :func:`init` installs it, as does the first ``paratrain.comm`` call on a Gloo group (shm included);
    so does ``paratrain launch --guard`` for any script. Any other script under plain ``paratrain
    launch`` or ``torchrun`` gets none: see docs/launch.md, "A rank aborts at exit"."""
    global _exit_grace_installed
    if not _exit_grace_installed:
        # atexit runs handlers last-in first-out, so this one runs after every handler registered later:
        # under ``launch --guard`` that is all of the script's. All of them run before finalization.
        atexit.register(time.sleep, EXIT_GRACE_S)
        _exit_grace_installed = True


def shutdown() -> None:
    """Destroy the process group if one exists. Safe to call twice.

    The grace that keeps a Gloo worker thread from aborting the process at exit is an ``atexit`` handler
    (:func:`install_exit_grace`, installed by :func:`init`), so it also covers a run that never gets
    here."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def print0(*args: Any, ctx: Context | None = None, **kwargs: Any) -> None:
    """``print`` on rank 0 only (RANK from the environment when no context is given)."""
    rank = ctx.rank if ctx is not None else _env_int("RANK", 0)
    if rank == 0:
        print(*args, **kwargs)


class _ConsoleFilter(logging.Filter):
    """The console shows rank 0's records and only the warnings and errors of the other ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def get_logger(ctx: Context | None = None, level: int = logging.INFO) -> logging.Logger:
    """The ``paratrain`` logger. Its console handler (stderr) drops records below WARNING on ranks other
    than 0 and prefixes theirs with ``[rank r]``; a worker's rank log (:mod:`paratrain.train.logs`) keeps
    every record of its rank."""
    rank = ctx.rank if ctx is not None else _env_int("RANK", 0)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name("paratrain-console")
        log.addHandler(handler)
        log.propagate = False
    for h in log.handlers:
        if h.get_name() == "paratrain-console":
            prefix = f"[rank {rank}] " if rank != 0 else ""
            h.setFormatter(logging.Formatter(prefix + "[paratrain %(levelname)s] %(message)s"))
            h.filters = [_ConsoleFilter(rank)]
    log.setLevel(level)
    return log


def device_synchronizer(device: torch.device) -> Callable[[], None]:
    """``torch.cuda.synchronize`` on CUDA, a no-op elsewhere (nanochat's one-helper rule)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def record_errors(fn: Any) -> Any:
    """Decorate a worker ``main``: on an exception, write the agent's error file, print one line, exit 1.

    This replaces torch's ``@record`` (which re-raises and so prints a full traceback on every rank):
    the launcher prints the first failure once, with the traceback's last frame.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            return fn(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt):  # Ctrl-C is the launcher's to report, not this rank's error
            raise
        except BaseException as e:
            raised_at = time.time()
            handler = ErrorHandler()
            handler.initialize()
            path = os.environ.get("TORCHELASTIC_ERROR_FILE")
            reason = permanent_reason(e)
            if reason is not None:
                _forbid_restart(e, reason)
            if path:
                _write_error_file(path, e, raised_at)
                rank = os.environ.get("RANK", "?")
                print(f"[rank {rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            else:
                raise
            sys.exit(1)

    return wrapper


NO_RESTART_ENV = "PARATRAIN_NO_RESTART_FILE"
"""Where a worker records a failure that no restart can fix (set by ``paratrain launch``); the launcher
reads it before restarting the group and ends the job instead (:mod:`paratrain.launch.signals`)."""


def _forbid_restart(e: BaseException, reason: str) -> None:
    """Record ``e`` in the launcher's no-restart file; the first rank to fail this way keeps its record."""
    path = os.environ.get(NO_RESTART_ENV)
    if not path:
        return
    record = {"rank": _env_int("RANK", 0), "message": f"{type(e).__name__}: {e}", "reason": reason}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # another rank was first, or the launcher's directory is gone
        return
    with os.fdopen(fd, "w") as fp:
        json.dump(record, fp)


def _write_error_file(path: str, e: BaseException, raised_at: float) -> None:
    """The agent's error file, in the layout torch's ``ErrorHandler.record_exception`` writes, plus the
    time the exception was caught to the microsecond (``raised_at``): torch's own ``timestamp`` is whole
    seconds, too coarse to tell which of two ranks failed first."""
    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(raised_at)),
                "raised_at": repr(raised_at),
            },
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError as err:
        print(f"paratrain: could not write the error file {path}: {err}", file=sys.stderr, flush=True)
