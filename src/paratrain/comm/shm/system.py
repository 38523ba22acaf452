"""The machine under :mod:`paratrain.comm.shm`: memory fences, futex, process liveness, segment names.

Nothing here knows about collectives. :mod:`paratrain.comm.shm.segment` maps a segment and waits on its
flags with these; :mod:`paratrain.comm.shm`'s docstring describes the protocol they serve.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from paratrain.procfs import start_time

SEGMENT_PREFIX = "paratrain-shm-"
"""Every segment name starts with this (``/dev/shm/paratrain-shm-...``)."""

# Waiting: spin, then yield, then block in futex (or, without futex, sleep with exponential backoff).
SPINS = 64
YIELD_S = 50e-6
NAP_MIN_S = 20e-6
NAP_MAX_S = 200e-6
CHECK_S = 0.05
"""How often a blocked waiter checks whether the ranks it waits for are alive."""

_ALIGN = 64
_PAGE = 4096


def _make_fence() -> Callable[[], None] | None:
    """A full memory fence callable, a no-op on x86 (TSO); ``None`` when none can be had."""
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86"):
        return lambda: None
    path = ctypes.util.find_library("atomic")
    if path:
        try:
            fence = ctypes.CDLL(path).atomic_thread_fence
        except (OSError, AttributeError):
            return None
        fence.argtypes, fence.restype = [ctypes.c_int], None
        return lambda: fence(5)  # memory_order_seq_cst
    return None


_FENCE = _make_fence()


def _fence() -> None:
    if _FENCE is not None:
        _FENCE()


_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221,
              "ppc64": 221, "s390x": 238, "i386": 240, "i686": 240, "armv7l": 240}  # fmt: skip


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """``FUTEX_WAIT`` / ``FUTEX_WAKE`` on a 32-bit word of the shared mapping (Linux), through libc's
    ``syscall()``. Shared (not ``_PRIVATE``) futexes, because the waiters are other processes. ctypes
    releases the GIL for the call, so a waiting hook thread does not block the training thread."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.syscall
        self._call.restype = ctypes.c_long
        self._nr = ctypes.c_long(_SYS_FUTEX[platform.machine().lower()])

    def wait(self, addr: int, expected: int, timeout_s: float) -> None:
        """Sleep while the word at ``addr`` equals ``expected`` (low 32 bits), at most ``timeout_s``."""
        ts = _Timespec(int(timeout_s), int(timeout_s % 1 * 1e9))
        self._call(self._nr, ctypes.c_void_p(addr), 0, ctypes.c_int(expected), ctypes.byref(ts), None, 0)

    def wake(self, addr: int) -> None:
        """Wake every process sleeping on the word at ``addr``."""
        self._call(self._nr, ctypes.c_void_p(addr), 1, 0x7FFFFFFF, None, None, 0)


def _make_futex() -> _Futex | None:
    if platform.system() != "Linux" or platform.machine().lower() not in _SYS_FUTEX:
        return None
    try:
        return _Futex()
    except (OSError, AttributeError):
        return None


_FUTEX = _make_futex()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> int:
    m = (
        re.search(r"\[(\d+)\]", os.readlink("/proc/self/ns/pid"))
        if os.path.exists("/proc/self/ns/pid")
        else None
    )
    return int(m.group(1)) if m else 0


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; ``None`` if gone or a zombie (a SIGKILLed child nobody
    has reaped yet is dead for our purpose)."""
    return start_time(pid)


def _host_info() -> dict[str, Any]:
    """What must agree for ranks to share /dev/shm (host name, kernel boot id), and the pid namespace
    (the liveness check reads peers' /proc entries only when every rank is in the same one)."""
    return {
        "host": socket.gethostname(),
        "boot": _read("/proc/sys/kernel/random/boot_id"),
        "pidns": _pid_namespace(),
    }


def _slug(text: str, limit: int = 24) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", text)[:limit] or "x"


def _job_id() -> str:
    return _slug(os.environ.get("PARATRAIN_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "local")


def _sweep_stale(shm_dir: str) -> None:
    """Unlink names left by a creator that died inside the creation window (same pid namespace only)."""
    ns = _pid_namespace()
    try:
        names = [n for n in os.listdir(shm_dir) if n.startswith(SEGMENT_PREFIX)]
    except OSError:
        return
    for name in names:
        parts = name[len(SEGMENT_PREFIX) :].split("-")
        if len(parts) < 2 or not (parts[0].isdigit() and parts[1].isdigit()) or int(parts[0]) != ns:
            continue
        if int(parts[1]) != os.getpid() and _start_time(int(parts[1])) is None:
            try:
                os.unlink(os.path.join(shm_dir, name))
            except OSError:
                pass


def _align(x: int, to: int = _ALIGN) -> int:
    return (x + to - 1) // to * to


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _group_timeout(pg: Any) -> float:
    """The process group's timeout (its store carries it), else 300 s."""
    try:
        store = dist.distributed_c10d._get_process_group_store(pg)
        return float(getattr(store, "timeout").total_seconds())  # noqa: B009 (not in the stubs)
    except Exception:
        return 300.0


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF)


class _VmReader:
    """``process_vm_readv(2)`` / ``process_vm_writev(2)`` through libc (Linux "cross-memory attach"): copy
    bytes straight out of (into) another process's address space, one kernel copy, no intermediate
    buffer. Permitted when the caller may ptrace the target (same user; under Yama ``ptrace_scope`` 1 the
    target must allow it with :meth:`allow_peers`). ctypes releases the GIL for the call."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._calls: dict[str, Any] = {}
        for name in ("process_vm_readv", "process_vm_writev"):
            f = getattr(libc, name)
            f.restype = ctypes.c_ssize_t
            f.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                          ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]  # fmt: skip
            self._calls[name] = f
        self._prctl = libc.prctl

    def read(self, pid: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` from address ``remote`` of process ``pid`` to ``local``; ``OSError`` on failure
        (``ESRCH``: the process is gone; ``EPERM``: not allowed; ``EFAULT``: a bad address)."""
        self._move("process_vm_readv", pid, local, remote, nbytes)

    def write(self, pid: int, local: int, remote: int, nbytes: int) -> None:
        """Copy ``nbytes`` from ``local`` to address ``remote`` of process ``pid``; errors as :meth:`read`."""
        self._move("process_vm_writev", pid, local, remote, nbytes)

    def _move(self, name: str, pid: int, local: int, remote: int, nbytes: int) -> None:
        call, done = self._calls[name], 0
        while done < nbytes:
            loc = _Iovec(local + done, nbytes - done)
            rem = _Iovec(remote + done, nbytes - done)
            got = call(pid, ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
            if got <= 0:
                err = ctypes.get_errno() if got < 0 else 0
                raise OSError(err, f"{name} with pid {pid}: {os.strerror(err) if err else 'no data'}")
            done += got

    def allow_peers(self) -> None:
        """Let processes of this user read this one under Yama ``ptrace_scope`` 1 (``PR_SET_PTRACER_ANY``;
        without Yama the call fails harmlessly and nothing changes: same-user access is already allowed)."""
        self._prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def _make_vm_reader() -> _VmReader | None:
    if platform.system() != "Linux":
        return None
    try:
        return _VmReader()
    except (OSError, AttributeError):
        return None


_VM = _make_vm_reader()
