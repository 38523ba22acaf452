"""The first code every worker runs: ``python -S boot.py ENTRY...``, before its interpreter imports anything.

A worker must die with its launcher in every window, the seconds spent importing torch and waiting in the
rendezvous included. Run first, this file:

1. asks the kernel to SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``, Linux); the
   setting survives the ``execv`` below (it is cleared only for set-user-ID binaries);
2. then compares its own parent (``getppid``) with the launcher's pid (``PARATRAIN_LAUNCHER_PID``): a
   launcher that died between the fork and step 1 has already handed this process to another parent (init
   or a subreaper), and the parent-death signal would never fire, so it exits now. The order matters:
   checking first would leave a window in which the launcher dies unseen. No liveness probe of the pid is
   asked (``kill(pid, 0)``): a dead launcher that its own parent has not reaped yet still answers it;
3. pins itself to its block of cores under ``--cpu-bind cores`` (:mod:`cpu_bind`);
4. replaces itself with the real worker (``os.execv``): the pid stays the one the elastic agent watches.

This file imports only the standard library, none of it named like a file of this directory: run as a
script, its directory comes first on ``sys.path``.
"""

from __future__ import annotations

import os
import sys

LAUNCHER_ENV = "PARATRAIN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> bool:
    """SIGKILL this process when its parent dies (Linux with glibc or musl); ``False`` where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util
    import signal

    for name in ("libc.so.6", ctypes.util.find_library("c")):
        if not name:
            continue
        try:
            libc = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    return False


def launcher_gone() -> bool:
    """Whether the launcher recorded in ``PARATRAIN_LAUNCHER_PID`` is no longer this process's parent.

    The kernel re-parents a process the moment its parent exits, before the parent becomes a zombie, so
    this is exact where a liveness probe of the pid is not. ``False`` when no paratrain launcher started
    this process (plain ``torchrun``)."""
    try:
        launcher = int(os.environ.get(LAUNCHER_ENV, "0") or 0)
    except ValueError:
        return False
    return launcher > 0 and os.getppid() != launcher


def guard() -> None:
    """Steps 1 and 2 of the module docstring: die with the launcher, or exit now if it is already gone."""
    set_parent_death_signal()
    if launcher_gone():
        rank = os.environ.get("RANK", "?")
        os.write(2, f"[paratrain] rank {rank}: the launcher is gone; exiting\n".encode())
        os._exit(1)


QUIET_MAIN = (
    "import os, runpy, signal, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "signal.signal(signal.SIGINT, lambda *_: os._exit(130))\n"
    "try:\n"
    "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
    "except KeyboardInterrupt:\n"
    "    os._exit(130)\n"
)
"""``python -c QUIET_MAIN MODULE ARGS`` runs ``python -m MODULE ARGS`` but exits 130 without a traceback on
Ctrl-C: the terminal's SIGINT reaches every worker of the process group, often while it imports torch, and
the launcher reports the interruption once. Until the worker restores Python's handler (once its process
group is up, so that cleanup runs from there on), SIGINT exits at once: a KeyboardInterrupt raised inside a
C++ callback of torch's start-up aborts the process with a C++ message instead."""

QUIET_MODULES = ("paratrain.train.worker",)
"""Worker modules started as ``-c QUIET_MAIN`` (``paratrain train``'s; a user's script keeps Python's
behaviour)."""


def main(argv: list[str]) -> None:
    if "-m" in argv and argv.index("-m") + 1 < len(argv) and argv[argv.index("-m") + 1] in QUIET_MODULES:
        i = argv.index("-m")
        argv = [*argv[:i], "-c", QUIET_MAIN, *argv[i + 1 :]]
    guard()
    import cpu_bind  # this directory's module (see the module docstring)

    if os.environ.get(cpu_bind.BLOCKS_ENV):
        cpu_bind.pin(cpu_bind.decode(os.environ[cpu_bind.BLOCKS_ENV]), int(os.environ["LOCAL_RANK"]))
    os.execv(sys.executable, [sys.executable, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
