"""Process plumbing of a worker: its attempt number, the watch on its launcher, and a clean exit.

A worker must not outlive the ``paratrain launch`` process that started it (:func:`die_with_launcher`,
:func:`launcher_gone`, and the store connection that gives up when the launcher is gone), and must not
abort at exit while a Gloo thread still finishes a collective (:func:`install_exit_grace`).
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time
from typing import Any

import torch.distributed as dist


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def attempt() -> int:
    """Which start of the worker group this is (0: the first), the same on every node.

    torch's ``TORCHELASTIC_RESTART_COUNT`` is counted by each agent: when one node's worker dies, that
    agent counts a restart and the others, restarting for the membership change, do not (pytorch#135712),
    so it cannot name an attempt across nodes. Under ``paratrain launch`` the rendezvous wrapper
    (:class:`paratrain.launch.signals.GuardedRendezvous`) publishes the round's first agent's count to all
    of them (``PARATRAIN_ATTEMPT``); otherwise the per-agent count is all there is."""
    return env_int("PARATRAIN_ATTEMPT", env_int("TORCHELASTIC_RESTART_COUNT", 0))


def attempt_key() -> str:
    """A store-key prefix unique to this start of the worker group and the same on every node: the
    rendezvous round's token under ``paratrain launch`` (``PARATRAIN_ROUND_KEY``), else :func:`attempt`."""
    return os.environ.get("PARATRAIN_ROUND_KEY") or str(attempt())


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
    launcher = env_int("PARATRAIN_LAUNCHER_PID", 0)
    return launcher > 0 and os.getppid() != launcher


STORE_TRY_S = 3.0
"""How long one attempt to connect to the launcher's store lasts; between attempts a worker checks that its
launcher is alive, so a worker never waits longer than this for a dead one."""


def connect_agent_store(host: str, port: int, world_size: int, timeout_s: float) -> Any:
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
