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
    parse_rdzv_conf(launch.rdzv_conf)
    explicit_port = launch.master_port is not None and launch.rdzv_endpoint is None
    if explicit_port and port_in_use("127.0.0.1", launch.master_port):  # type: ignore[arg-type]
        raise ConfigError(
            f"port {launch.master_port} on 127.0.0.1 is already in use (another job?). Pick another "
            "--master-port, or leave it out and paratrain picks a free port."
        )


# Settings of torch's dynamic (c10d) rendezvous (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py,
# c10d_rendezvous_backend.py), all in seconds except keep_alive_max_attempt. How long a membership change takes:
# a dead node leaves the rendezvous keep_alive_interval * keep_alive_max_attempt after its last heartbeat, then
# the survivors wait last_call_timeout for more nodes before the new round starts.
_RDZV_INT_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
)


def parse_rdzv_conf(text: str | None) -> dict[str, Any]:
    """``"last_call_timeout=5,keep_alive_interval=1"`` -> ``{"last_call_timeout": 5, ...}`` (torchrun's
    ``--rdzv-conf``). Raises :class:`ConfigError` naming an unknown key or a bad value."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if key == "is_host" and sep:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ConfigError(f"--rdzv-conf is_host={value!r}: write true or false.")
            out[key] = value.lower() in ("true", "1")
        elif key in _RDZV_INT_KEYS and sep and value.isdigit() and int(value) > 0:
            out[key] = int(value)
        else:
            raise ConfigError(
                f"--rdzv-conf {item.strip()!r}: write KEY=SECONDS with KEY one of {', '.join(_RDZV_INT_KEYS)} "
                "(keep_alive_max_attempt is a count), or is_host=true|false; separate entries with commas."
            )
    return out


LOOPBACK_BACKEND = "paratrain-loopback"


def _create_loopback_handler(params: Any) -> Any:
    """The c10d rendezvous of a single-node job, with its TCPStore listening on 127.0.0.1 only.

    ``TCPStore(host, ...)`` listens on *every* interface whatever ``host`` says (verified on torch 2.13 with
    ``ss -ltn``: ``*:PORT``), so a standalone job would expose its store to the network. Here paratrain binds
    the listening socket itself to ``127.0.0.1`` and hands it to the store (``master_listen_fd``); the rest is
    torch's own dynamic rendezvous handler.
    """
    import datetime

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    def loopback_store(port: int) -> TCPStore:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # port 0: the kernel picks a free port atomically
        sock.listen(512)
        return TCPStore(
            "127.0.0.1",
            sock.getsockname()[1],
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            master_listen_fd=sock.detach(),  # the store owns the descriptor from now on
            timeout=datetime.timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60)),
        )

    store = loopback_store(int(params.endpoint.rsplit(":", 1)[1]) if ":" in params.endpoint else 0)

    class _LoopbackBackend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return LOOPBACK_BACKEND

    handler = create_handler(store, _LoopbackBackend(store, params.run_id), params)
    # The handler starts a second store for the workers (TCPStore sharing); it must be loopback-only too.
    handler._create_tcp_store_server = lambda addr, port: loopback_store(port)  # type: ignore[method-assign,assignment]
    return handler


def _register_loopback_backend() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    try:
        registry.register(LOOPBACK_BACKEND, _create_loopback_handler)
    except ValueError:
        pass  # already registered in this process


def resolve(launch: LaunchConfig) -> LaunchConfig:
    """``launch`` with what the environment implies filled in: inside a multi-node Slurm allocation, the
    node count, node rank, rendezvous endpoint and id (explicit flags win)."""
    from paratrain import slurm

    return slurm.apply(launch)


def is_standalone(launch: LaunchConfig) -> bool:
    return launch.rdzv_endpoint is None and launch.nnodes == "1"


def _elastic_config(launch: LaunchConfig, nproc: int) -> Any:
    from torch.distributed.launcher.api import LaunchConfig as ElasticLaunchConfig

    parts = launch.nnodes.split(":")
    min_nodes, max_nodes = int(parts[0]), int(parts[-1])
    # "timeout" is the join timeout of the static and etcd rendezvous, "join_timeout" that of c10d (torch's
    # default is 600 s): how long an agent waits for the others before it fails instead of hanging.
    join = int(max(60, launch.timeout_s))
    rdzv_configs: dict[str, Any] = {"timeout": join, "join_timeout": join}
    if launch.rdzv_endpoint:
        # Multi-node: torch's c10d rendezvous. The store host listens on all interfaces (it must be reachable
        # from the other nodes): run it on a private network only (docs/launch.md).
        endpoint = launch.rdzv_endpoint
        run_id = launch.rdzv_id or os.environ.get("SLURM_JOB_ID") or "paratrain"
        backend = launch.rdzv_backend
        rdzv_configs["rank"] = launch.node_rank  # as torchrun passes it (used by static rendezvous)
        host = endpoint.rsplit(":", 1)[0]
        if host in ("127.0.0.1", "localhost") and backend == "c10d":
            rdzv_configs["is_host"] = launch.node_rank == 0  # several agents on one machine: node 0 hosts
        local_addr = "127.0.0.1" if host in ("127.0.0.1", "localhost") else None
    else:
        if max_nodes > 1:
            raise ConfigError(
                f"--nnodes {launch.nnodes} needs --rdzv-endpoint HOST:PORT (the same on every node), or run "
                "inside a Slurm allocation, where it is filled in."
            )
        # Standalone: a store on 127.0.0.1 only; port 0 lets the OS pick a free one atomically.
        port = launch.master_port if launch.master_port is not None else 0
        endpoint = f"127.0.0.1:{port}"
        run_id = launch.rdzv_id or str(uuid.uuid4())
        backend = LOOPBACK_BACKEND if launch.rdzv_backend == "c10d" else launch.rdzv_backend
        _register_loopback_backend()
        local_addr = "127.0.0.1"
    rdzv_configs.update(parse_rdzv_conf(launch.rdzv_conf))  # explicit settings win
    return ElasticLaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        max_restarts=launch.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
        # SIGTERM and SIGUSR1 are paratrain's (agent_signals.StopForwarder), not torch's immediate teardown.
        signals_to_handle="SIGINT,SIGHUP,SIGQUIT",
    )


def _worker_env(nproc: int, standalone: bool = False) -> None:
    # Two ranks each spinning up one OpenMP thread per core would oversubscribe a small CPU machine.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if standalone and sys.platform.startswith("linux"):
        # Gloo and NCCL pick their listening interface from the hostname, which usually resolves to a
        # network address; a single-node job has no reason to listen there. Explicit settings win.
        lo = next((name for _, name in socket.if_nameindex() if name == "lo"), None)
        if lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


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
        if not msg or msg == "<NONE>" or msg.startswith("To enable traceback"):
            msg = _describe_exit(f.exitcode)
        out.append(RankFailure(rank, f.local_rank, f.exitcode, msg, tb, int(f.timestamp or 0)))
    return sorted(out, key=_root_cause_order)


def _root_cause_order(f: RankFailure) -> tuple[int, int, int]:
    """Root cause first: a recorded exception, then a non-zero exit, then a signal; last, SIGTERM, which
    the agent itself sends to the surviving ranks once one has failed."""
    if f.traceback:
        kind = 0
    elif f.exitcode > 0:
        kind = 1
    elif f.exitcode == -signal.SIGTERM:
        kind = 3
    else:
        kind = 2
    return (kind, f.timestamp, f.rank)


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
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def run(entry: list[str], launch: LaunchConfig, quiet: bool = True) -> dict[int, Any]:
    """Run ``sys.executable <entry...>`` on every local rank under the elastic agent.

    Raises :class:`LaunchError` naming the first failing rank.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import launch_agent

    from paratrain.agent_signals import StopForwarder, describe_teardown, grace_s, guarded_backend

    launch = resolve(launch)
    preflight(launch)
    nproc = resolve_nproc(launch)
    _worker_env(nproc, standalone=is_standalone(launch))
    if quiet:
        _quiet_agent_logs()
    config = _elastic_config(launch, nproc)
    # SIGTERM/SIGUSR1: forwarded to the workers, which save and exit; no restart after (agent_signals.py)
    stop = StopForwarder(grace_s(launch.timeout_s))
    config.rdzv_backend = guarded_backend(config.rdzv_backend, stop)
    stop.install()
    try:
        return dict(launch_agent(config, sys.executable, list(entry)))
    except ChildFailedError as err:
        failures = _failures(err)
        raise LaunchError(_format_failure(failures, launch.max_restarts), failures) from None
    except SignalException as e:
        raise LaunchError(
            describe_teardown(signal.Signals(e.sigval), stop, config.shutdown_timeout)
        ) from None
    finally:
        stop.restore()


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


def preflight_train(cfg: Any, world: int, strategy: Any) -> None:
    """Launch checks of ``paratrain train`` that need the whole config. Raises :class:`ConfigError`.

    - an elastic range ``MIN:MAX``: the global batch must split evenly at *every* world size in the range;
    - ``--fail-rank`` must exist;
    - multi-node: every node must write into the same run directory (on a shared filesystem), so it is
      ``--run-dir``, or ``runs/<rdzv-id>`` derived from the job id shared by all nodes.
    """
    launch = cfg.launch
    parts = launch.nnodes.split(":")
    nproc = resolve_nproc(launch)
    for nodes in range(int(parts[0]), int(parts[-1]) + 1):
        size = nproc * nodes
        try:
            strategy.check(size, cfg.strategy)
            cfg.validate(size, strategy.data_parallel_size(size, cfg.strategy))
        except ConfigError as e:
            raise ConfigError(
                f"--nnodes {launch.nnodes}: at {nodes} node(s) (world size {size}): {e}"
            ) from None
    if launch.fail_at_step is not None and launch.fail_rank >= world:
        raise ConfigError(
            f"--fail-rank {launch.fail_rank} does not exist: the world size is {world} "
            f"(ranks 0..{world - 1})."
        )
    if launch.nnodes != "1" and cfg.train.run_dir is None and cfg.checkpoint.dir is None:
        if not launch.rdzv_id:
            raise ConfigError(
                "a multi-node run needs one run directory shared by all nodes: pass the same --run-dir (on a "
                "shared filesystem) to every node, or --rdzv-id ID to use runs/ID."
            )
        cfg.train.run_dir = os.path.join("runs", launch.rdzv_id)


def wait_for_summary(path: Any, timeout_s: float = 15.0) -> bool:
    """Multi-node: rank 0 (maybe on another node) writes the summary after its agent's peers finished."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.isfile(path):
            return True
        time.sleep(0.2)
    return False
