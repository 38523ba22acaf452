"""Start workers with the real torch elastic agent (``torch.distributed.run``), called from Python.

paratrain does not re-implement torchrun: it builds ``torch.distributed.launcher.api.LaunchConfig`` and
calls ``launch_agent``. What it adds:

- a standalone default: c10d rendezvous on ``127.0.0.1`` port 0, so the operating system picks a free port
  and two jobs started at once never collide ("address already in use");
- checks before anything starts: an explicitly given port that is busy, more processes than GPUs;
- failures reported as one paragraph naming the first failing rank and its error, read from the agent's
  error files (``TORCHELASTIC_ERROR_FILE``), instead of a traceback per rank.

Reference: https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import Any

from paratrain.config import ConfigError, LaunchConfig


class LaunchError(RuntimeError):
    """A worker group failed; ``str()`` names the first failing rank and its error."""

    def __init__(self, message: str, failures: list[RankFailure] | None = None) -> None:
        super().__init__(message)
        self.failures = failures or []


@dataclass
class RankFailure:
    rank: int
    local_rank: int
    exitcode: int
    message: str
    traceback: str
    timestamp: int


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_nproc(launch: LaunchConfig) -> int:
    """``nproc_per_node`` or its default: one per GPU when GPUs are present, else 2 CPU processes."""
    if launch.nproc_per_node is not None:
        return launch.nproc_per_node
    if launch.device != "cpu":
        gpus = gpu_count()
        if gpus > 0:
            return gpus
    return 2


def preflight(launch: LaunchConfig) -> None:
    """Checks that must fail before any process starts. Raises :class:`ConfigError`."""
    nproc = resolve_nproc(launch)
    gpus = gpu_count()
    uses_cuda = launch.device == "cuda" or (launch.device == "auto" and gpus > 0)
    if uses_cuda and nproc > gpus:
        raise ConfigError(
            f"--nproc-per-node {nproc} but this machine has {gpus} GPU(s): start at most one process per GPU "
            f"(--nproc-per-node {gpus}), or run on CPU with --set launch.device=cpu."
        )
    if launch.device == "cuda" and gpus == 0:
        raise ConfigError("launch.device='cuda' but no CUDA GPU is visible. Use --set launch.device=cpu.")
    if launch.master_port is not None and launch.rdzv_endpoint is None:
        if port_in_use("127.0.0.1", launch.master_port):
            raise ConfigError(
                f"port {launch.master_port} on 127.0.0.1 is already in use (another job?). Pick another "
                "--master-port, or leave it out and paratrain picks a free port."
            )


def _elastic_config(launch: LaunchConfig, nproc: int) -> Any:
    from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig

    parts = launch.nnodes.split(":")
    min_nodes, max_nodes = int(parts[0]), int(parts[-1])
    if launch.rdzv_endpoint:
        endpoint = launch.rdzv_endpoint
        run_id = launch.rdzv_id or os.environ.get("SLURM_JOB_ID") or "paratrain"
    else:
        # Standalone: bind the c10d store to loopback; port 0 lets the OS pick a free one atomically.
        port = launch.master_port if launch.master_port is not None else 0
        endpoint = f"127.0.0.1:{port}"
        run_id = launch.rdzv_id or str(uuid.uuid4())
    rdzv_configs: dict[str, Any] = {"timeout": int(max(60, launch.timeout_s))}
    if max_nodes == 1 and not launch.rdzv_endpoint:
        rdzv_configs["is_host"] = True
    return ElasticLaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_endpoint=endpoint,
        rdzv_backend=launch.rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=launch.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr="127.0.0.1" if not launch.rdzv_endpoint else None,
    )


def _worker_env(nproc: int) -> None:
    # Two ranks each spinning up one OpenMP thread per core would oversubscribe a small CPU machine.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _failures(err: Any) -> list[RankFailure]:
    out = []
    for rank, f in err.failures.items():
        data = f.error_file_data.get("message", {}) if isinstance(f.error_file_data, dict) else {}
        if isinstance(data, dict):
            msg = data.get("message", "") or ""
            tb = (data.get("extraInfo") or {}).get("py_callstack", "") or ""
        else:
            msg, tb = str(data), ""
        if not msg or msg.startswith("To enable traceback"):
            msg = _describe_exit(f.exitcode)
        out.append(RankFailure(rank, f.local_rank, f.exitcode, msg, tb, int(f.timestamp or 0)))
    return sorted(out, key=lambda r: (r.timestamp, r.rank))


def _format_failure(failures: list[RankFailure], attempts: int) -> str:
    first = failures[0]
    lines = [f"rank {first.rank} failed ({_describe_exit(first.exitcode)}): {first.message}"]
    frame = _last_frame(first.traceback)
    if frame:
        lines.append(f"  at {frame}")
    others = [f.rank for f in failures[1:]]
    if others:
        lines.append(f"  ranks {others} stopped after it.")
    if attempts > 0:
        lines.append(f"  (after {attempts} restart(s) by the elastic agent)")
    return "\n".join(lines)


def _last_frame(tb: str) -> str:
    frames = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith('File "')]
    return frames[-1] if frames else ""


def _quiet_agent_logs() -> None:
    # The agent logs every rendezvous round at INFO/WARNING; paratrain reports failures itself.
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run(entry: list[str], launch: LaunchConfig, quiet: bool = True) -> dict[int, Any]:
    """Run ``sys.executable <entry...>`` on every local rank under the elastic agent.

    Raises :class:`LaunchError` naming the first failing rank.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import launch_agent

    preflight(launch)
    nproc = resolve_nproc(launch)
    _worker_env(nproc)
    if quiet:
        _quiet_agent_logs()
    config = _elastic_config(launch, nproc)
    try:
        return dict(launch_agent(config, sys.executable, list(entry)))
    except ChildFailedError as err:
        failures = _failures(err)
        raise LaunchError(_format_failure(failures, launch.max_restarts), failures) from None


def run_module(module: str, argv: list[str], launch: LaunchConfig, quiet: bool = True) -> dict[int, Any]:
    """Run ``python -m module argv...`` on every local rank (see :func:`run`)."""
    return run(["-u", "-m", module, *argv], launch, quiet=quiet)


def run_script(script: str, argv: list[str], launch: LaunchConfig, quiet: bool = True) -> dict[int, Any]:
    """Run ``python script argv...`` on every local rank: ``paratrain launch`` as a torchrun drop-in."""
    if not os.path.isfile(script):
        raise ConfigError(f"script {script!r} does not exist. Give the path of a Python file to run.")
    return run(["-u", script, *argv], launch, quiet=quiet)


def record_errors(fn: Any) -> Any:
    """Decorate a worker ``main``: on an exception, write the agent's error file, print one line, exit 1.

    This replaces torch's ``@record`` (which re-raises and so prints a full traceback on every rank):
    the launcher prints the first failure once, with the traceback's last frame.
    """
    import functools

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as e:
            handler = ErrorHandler()
            handler.initialize()
            if os.environ.get("TORCHELASTIC_ERROR_FILE"):
                handler.record_exception(e)
                rank = os.environ.get("RANK", "?")
                print(f"[rank {rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            else:
                raise
            sys.exit(1)

    return wrapper
