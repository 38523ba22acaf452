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
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from typing import Any

from paratrain.config import LaunchConfig
from paratrain.errors import ConfigError
from paratrain.launch import cpu_bind
from paratrain.launch.failures import LaunchError, format_failure, read_failures
from paratrain.launch.rendezvous import (
    LOOPBACK_BACKEND,
    _register_loopback_backend,
    is_loopback_host,
    is_loopback_job,
    parse_rdzv_conf,
    port_in_use,
    split_endpoint,
)
from paratrain.launch.watch import WorkerWatch


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
    if launch.device == "cuda" and gpus == 0:
        raise ConfigError("--device cuda was asked for, but no CUDA GPU is visible. Use --device cpu.")
    if uses_cuda and nproc > gpus:
        raise ConfigError(
            f"--nproc-per-node {nproc} but this machine has {gpus} GPU(s): start at most one process per GPU "
            f"(--nproc-per-node {gpus}), or run on the CPU with --device cpu."
        )
    if launch.backend == "nccl" and not uses_cuda:
        raise ConfigError(
            f"--backend nccl needs CUDA GPUs, and this run is on the CPU ({gpus} GPU(s) visible, device "
            f"{launch.device}). Use --backend gloo (or auto)."
        )
    if launch.cpu_bind != "none" and not cpu_bind.supported():
        raise ConfigError(
            f"--cpu-bind {launch.cpu_bind} pins workers with os.sched_setaffinity, which {sys.platform} does "
            "not have (Linux does). Leave it out (--cpu-bind none)."
        )
    parse_rdzv_conf(launch.rdzv_conf)
    explicit_port = launch.master_port is not None and launch.rdzv_endpoint is None
    if explicit_port and port_in_use("127.0.0.1", launch.master_port):  # type: ignore[arg-type]
        raise ConfigError(
            f"port {launch.master_port} on 127.0.0.1 is already in use (another job?). Pick another "
            "--master-port, or leave it out and paratrain picks a free port."
        )


def resolve(launch: LaunchConfig) -> LaunchConfig:
    """``launch`` with what the environment implies filled in: inside a multi-node Slurm allocation, the
    node count, node rank, rendezvous endpoint and id (explicit flags win)."""
    from paratrain.launch import slurm

    return slurm.apply(launch)


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
        host = split_endpoint(endpoint)[0]
        local_addr = None
        if is_loopback_host(host):
            # Several agents on one machine: node 0 serves the store, bound to loopback like every port
            # of the job (see rendezvous._create_loopback_handler).
            rdzv_configs["is_host"] = launch.node_rank == 0
            local_addr = "::1" if ":" in host else "127.0.0.1"
            if backend == "c10d":
                backend = LOOPBACK_BACKEND
                _register_loopback_backend()
        else:
            print(
                f"paratrain: warning: the rendezvous store at {endpoint} has no authentication: anyone who can "
                "reach it can join or disrupt the job. Use an address on a private network only.",
                file=sys.stderr,
            )
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


def _worker_env(nproc: int, loopback_only: bool = False) -> None:
    # Two ranks each spinning up one OpenMP thread per core would oversubscribe a small CPU machine. The
    # cores counted are the ones this process may use (a Slurm cpuset, taskset), as --cpu-bind's blocks.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(cpu_bind.allowed_cores()) // nproc))
    os.environ["PARATRAIN_LAUNCHER_PID"] = str(os.getpid())  # workers exit when this process dies
    if loopback_only and sys.platform.startswith("linux"):
        # Gloo and NCCL pick their listening interface from the hostname, which usually resolves to a
        # network address; a single-node job has no reason to listen there. Explicit settings win.
        lo = next((name for _, name in socket.if_nameindex() if name == "lo"), None)
        if lo is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)


def _boot_entry(entry: list[str], mode: str, nproc: int) -> list[str]:
    """Every worker starts through ``boot.py`` (``python -S boot.py ENTRY...``): before its interpreter
    imports anything it arranges to die with this process, and under ``--cpu-bind cores`` pins itself to its
    block of cores (the blocks travel in the environment); then it execs ``entry``."""
    from paratrain.launch import boot

    os.environ.pop(cpu_bind.BLOCKS_ENV, None)  # not inherited from an outer launch
    if mode != "none":
        cores = cpu_bind.allowed_cores()
        blocks = cpu_bind.core_blocks(cores, nproc)
        os.environ[cpu_bind.BLOCKS_ENV] = cpu_bind.encode(blocks)
        print(f"paratrain: {cpu_bind.describe(blocks, cores)}", file=sys.stderr)
    return ["-S", os.path.abspath(boot.__file__), *entry]


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

    from paratrain.launch.signals import (
        NoRestartError,
        StopForwarder,
        describe_teardown,
        grace_s,
        guarded_backend,
        stop_children,
    )
    from paratrain.runtime import NO_RESTART_ENV

    launch = resolve(launch)
    preflight(launch)
    nproc = resolve_nproc(launch)
    _worker_env(nproc, loopback_only=is_loopback_job(launch))
    cores = len(cpu_bind.allowed_cores())
    if nproc > cores:  # once per launch: run() starts one worker group
        print(f"paratrain: warning: {nproc} processes on {cores} CPU core(s): the cores are oversubscribed, "
              "so every rank waits for the others to be scheduled (fine for tests, slow for training).",
              file=sys.stderr)  # fmt: skip
    entry = _boot_entry(list(entry), launch.cpu_bind, nproc)
    if quiet:
        _quiet_agent_logs()
    config = _elastic_config(launch, nproc)
    # SIGTERM/SIGUSR1: forwarded to the workers, which save and exit; no restart after (launch/signals.py)
    stop = StopForwarder(grace_s(launch.timeout_s))
    # a worker records here a failure that no restart can fix; the next rendezvous ends the job instead
    scratch = tempfile.mkdtemp(prefix="paratrain-launch-")
    no_restart = os.environ[NO_RESTART_ENV] = os.path.join(scratch, "no_restart.json")
    config.rdzv_backend = guarded_backend(config.rdzv_backend, stop, no_restart, launch.max_restarts)
    stop.install()
    watch = WorkerWatch().start()  # a frozen worker is SIGKILLed once its group failed (launch/watch.py)
    try:
        return dict(launch_agent(config, sys.executable, list(entry)))
    except ChildFailedError as err:
        failures = read_failures(err)
        raise LaunchError(format_failure(failures, launch.max_restarts, watch.notes), failures) from None
    except NoRestartError as e:
        raise LaunchError(str(e)) from None
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        code = 130 if sig == signal.SIGINT else 1
        raise LaunchError(describe_teardown(sig, stop, config.shutdown_timeout), exit_code=code) from None
    except KeyboardInterrupt:
        # Ctrl-C before torch's agent handles SIGINT itself (it does once the workers' process context is
        # set up): workers already spawned run in sessions of their own, and the agent's log-tailing threads,
        # which the interpreter joins at exit, wait for them. They are stopped here, so the launcher exits.
        stop_children(config.shutdown_timeout)
        raise LaunchError(
            describe_teardown(signal.SIGINT, stop, config.shutdown_timeout), exit_code=130
        ) from None
    finally:
        watch.close()
        stop.restore()
        shutil.rmtree(scratch, ignore_errors=True)


def run_module(module: str, argv: list[str], launch: LaunchConfig, quiet: bool = True) -> dict[int, Any]:
    """Run ``python -m module argv...`` on every local rank (see :func:`run`)."""
    return run(["-u", "-m", module, *argv], launch, quiet=quiet)


def run_user_module(module: str, argv: list[str], launch: LaunchConfig, quiet: bool = True) -> dict[int, Any]:
    """``paratrain launch -m module``: ``python -m module argv...`` on every local rank, through
    script_runner.py as :func:`run_script` does, so the headline names an uncaught exception."""
    runner = os.path.join(os.path.dirname(__file__), "script_runner.py")
    return run(["-u", runner, "-m", module, *argv], launch, quiet=quiet)


def run_script(script: str, argv: list[str], launch: LaunchConfig, quiet: bool = True) -> dict[int, Any]:
    """Run ``python script argv...`` on every local rank: ``paratrain launch`` as a torchrun drop-in."""
    if not os.path.isfile(script):
        raise ConfigError(f"script {script!r} does not exist. Give the path of a Python file to run.")
    # through script_runner.py: an uncaught exception lands in the agent's error file, so the headline
    # names it for any script (started by path: nothing is imported before the script)
    return run(
        ["-u", os.path.join(os.path.dirname(__file__), "script_runner.py"), script, *argv],
        launch,
        quiet=quiet,
    )


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
            strategy.check(size, cfg.strategy, nproc)
            cfg.validate(size, strategy.data_parallel_size(size, cfg.strategy, nproc))
        except ConfigError as e:
            raise ConfigError(
                f"--nnodes {launch.nnodes}: at {nodes} node(s) (world size {size}): {e}"
            ) from None
    _check_sequence_split(cfg, world, strategy)
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


def _check_sequence_split(cfg: Any, world: int, strategy: Any) -> None:
    """Sequence parallelism (tp's default) splits every sequence into tp equal parts between the blocks."""
    if not getattr(strategy, "uses_tp", False) or not cfg.strategy.sequence_parallel:
        return
    tp = strategy.topology_for(world, cfg.strategy).tp
    if tp > 1 and cfg.data.seq_len % tp:
        raise ConfigError(
            f"--seq-len {cfg.data.seq_len} does not split into --tp {tp} equal parts: sequence parallelism "
            f"shards each sequence over the tp ranks. Use a --seq-len that is a multiple of {tp}, or "
            "--set strategy.sequence_parallel=false."
        )


def wait_for_summary(path: Any, timeout_s: float = 15.0) -> bool:
    """Multi-node: rank 0 (maybe on another node) writes the summary after its agent's peers finished."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if os.path.isfile(path):
            return True
        time.sleep(0.2)
    return False
