"""``paratrain doctor [--json] [--nproc-per-node N] [--timeout S]``: name the broken piece of a setup.

A distributed-training debugging checklist, as one command: check the environment, NCCL and the GPUs, then
the multi-node steps (network interface, master reachable, "test NCCL can communicate" with an expected
sum), plus the usual pitfalls and red flags (the LOCAL_RANK -> device mapping,
``NCCL_SOCKET_IFNAME`` / ``NCCL_IB_DISABLE``, /dev/shm in containers, open-file limits).

Checks run in order, cheapest first; every one prints one line (``ok``, ``warning`` or ``FAIL``) with the fix
when it is not ok, and the exit code is 1 when any check fails. The static network checks run before the
self-test, so that a wrong ``GLOO_SOCKET_IFNAME`` is named at once; the self-test then runs with a short
deadline to show the backend's own error. The whole command is bounded by ``--timeout`` (default 60 s):
the self-test gets what the static checks left, and its job is killed at the deadline.

``add_arguments`` and ``run`` are the CLI's; ``python -m paratrain.diagnose.doctor`` works too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from paratrain.diagnose.doctor_net import (
    Check,
    Interfaces,
    Status,
    check_gloo_ifname,
    check_ib_disable,
    check_master_addr,
    check_master_port,
    check_nccl_ifname,
    interfaces,
    local_addresses,
    resolve,
)
from paratrain.diagnose.doctor_selftest import find_slow_ranks, run_selftest, selftest_checks, skipped
from paratrain.errors import ConfigError
from paratrain.procfs import process_age

__all__ = ["Check", "add_arguments", "collect", "find_slow_ranks", "main", "run"]

SHM_MIN_BYTES = 1 << 30
NOFILE_MIN = 4096
_GiB = float(1 << 30)


# ---- software and devices ----------------------------------------------------------------------------------


def check_versions() -> Check:
    import torch

    import paratrain

    nccl = "none"
    try:
        if torch.cuda.is_available():
            version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except (AttributeError, RuntimeError):
        pass
    cuda = torch.version.cuda or "none (CPU build of torch)"  # type: ignore[attr-defined]
    return Check(
        "versions",
        "ok",
        f"python {platform.python_version()}, torch {torch.__version__}, CUDA {cuda}, NCCL {nccl}, "
        f"paratrain {paratrain.__version__}",
    )


def check_backends(gpus: int) -> Check:
    import torch.distributed as dist

    if not dist.is_available():
        return Check(
            "backends",
            "fail",
            "torch.distributed is not available in this torch build.",
            "install a torch wheel built with distributed support (the official Linux wheels are).",
        )
    have = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    detail = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in have.items())
    if not any(have.values()):
        return Check("backends", "fail", f"no process-group backend: {detail}.", "reinstall torch.")
    if gpus and not have["nccl"]:
        return Check(
            "backends",
            "warning",
            f"{detail}: GPUs are present but NCCL is not; Gloo on GPUs is slow.",
            "install a CUDA build of torch (it ships NCCL).",
        )
    return Check("backends", "ok", detail)


def _parse_visible(value: str) -> list[str]:
    return [] if value.strip() in ("", "-1") else [v.strip() for v in value.split(",")]


def check_gpus(env: Mapping[str, str]) -> list[Check]:
    """``gpus`` (count, name and memory each), ``CUDA_VISIBLE_DEVICES`` (when set), ``LOCAL_RANK``."""
    import torch

    built_for = torch.version.cuda  # type: ignore[attr-defined]
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    checks = []
    if count == 0:
        if built_for:
            hidden = f" CUDA_VISIBLE_DEVICES={visible!r} may hide them." if visible is not None else ""
            checks.append(
                Check(
                    "gpus",
                    "warning",
                    f"torch is built for CUDA {built_for} but sees no GPU.{hidden}",
                    "nvidia-smi must list the GPUs: check the driver (and --gpus all in docker), "
                    "or CUDA_VISIBLE_DEVICES.",
                )
            )
        else:
            checks.append(Check("gpus", "ok", "none (CPU build of torch): the self-test runs Gloo on CPU"))
    else:
        parts = []
        for i in range(count):
            props = torch.cuda.get_device_properties(i)
            free, _ = torch.cuda.mem_get_info(i)
            parts.append(
                f"cuda:{i} {props.name} {props.total_memory / _GiB:.1f} GiB ({free / _GiB:.1f} free)"
            )
        checks.append(Check("gpus", "ok", f"{count}: " + "; ".join(parts)))
    if visible is not None:
        checks.append(_check_visible(visible, count, bool(built_for)))
    checks.append(_check_local_rank(env, count, visible))
    return checks


def _check_visible(value: str, count: int, cuda_build: bool) -> Check:
    name = "CUDA_VISIBLE_DEVICES"
    entries = _parse_visible(value)
    if not entries:
        status: Status = "warning" if cuda_build else "ok"
        return Check(
            name, status, f"{name}={value!r} hides every GPU.", f"unset {name}, or list GPU indices."
        )
    bad = [e for e in entries if not (e.isdigit() or e.startswith(("GPU-", "MIG-")))]
    dupes = sorted({e for e in entries if entries.count(e) > 1})
    if bad or dupes:
        what = f"invalid entries {', '.join(bad)}" if bad else f"duplicates {', '.join(dupes)}"
        return Check(
            name,
            "fail" if cuda_build else "warning",
            f"{name}={value!r} has {what}: CUDA stops reading the list there.",
            "list each GPU once, by index (nvidia-smi -L) or UUID, separated by commas.",
        )
    if cuda_build and count != len(entries):
        return Check(
            name,
            "warning",
            f"{name}={value!r} lists {len(entries)} device(s) but CUDA sees {count}.",
            "list only GPUs that exist (nvidia-smi -L).",
        )
    mapping = ", ".join(f"cuda:{i} is GPU {e}" for i, e in enumerate(entries))
    return Check(name, "ok", f"{name}={value} -> {mapping}")


def _check_local_rank(env: Mapping[str, str], count: int, visible: str | None) -> Check:
    name = "LOCAL_RANK"
    value = env.get(name)
    if value is None:
        return Check(
            name,
            "ok",
            "not set (torchrun sets it per worker; pick the device with "
            "torch.device('cuda', LOCAL_RANK), never cuda:0)",
        )
    if not value.strip().isdigit():
        return Check(
            name,
            "fail",
            f"{name}={value!r} is not a non-negative integer.",
            "let torchrun / paratrain launch set LOCAL_RANK; do not set it by hand.",
        )
    local_rank = int(value)
    lws = env.get("LOCAL_WORLD_SIZE", "")
    if count == 0:
        return Check(name, "ok", f"{name}={local_rank} (no GPU here: nothing to map)")
    if local_rank >= count or (lws.isdigit() and int(lws) > count):
        return Check(
            name,
            "fail",
            f"{name}={local_rank} (LOCAL_WORLD_SIZE={lws or '?'}) but only {count} GPU(s) are "
            f"visible: ranks would share a GPU, or fail on cuda:{local_rank}.",
            f"start at most {count} process(es) per node (--nproc-per-node {count}), or check "
            "CUDA_VISIBLE_DEVICES.",
        )
    import torch

    physical = ""
    if visible is not None and local_rank < len(_parse_visible(visible)):
        physical = f", physical GPU {_parse_visible(visible)[local_rank]}"
    gpu = torch.cuda.get_device_name(local_rank)
    return Check(name, "ok", f"{name}={local_rank} -> cuda:{local_rank} ({gpu}{physical})")


# ---- the host ----------------------------------------------------------------------------------------------


def check_shm(path: str = "/dev/shm") -> Check:
    name = "/dev/shm"
    fix = (
        "docker run --shm-size=16g (or --ipc=host); Kubernetes: mount an emptyDir with medium: Memory "
        "at /dev/shm."
    )
    try:
        st = os.statvfs(path)
    except OSError:
        return Check(
            name, "warning", f"{path} is missing: NCCL and DataLoader workers share memory through it.", fix
        )
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    detail = f"{size / _GiB:.1f} GiB, {free / _GiB:.1f} GiB free"
    if size < SHM_MIN_BYTES or free < SHM_MIN_BYTES:
        return Check(
            name,
            "warning",
            f"{detail}: below 1 GiB; NCCL's shared-memory transport and DataLoader "
            "workers fail with 'Bus error' or 'No space left on device'.",
            fix,
        )
    return Check(name, "ok", detail)


def check_open_files() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    detail = f"RLIMIT_NOFILE soft {soft}, hard {hard_text}"
    if soft != resource.RLIM_INFINITY and soft < NOFILE_MIN:
        target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        return Check(
            "open files",
            "warning",
            f"{detail}: below {NOFILE_MIN}; every peer connection and every "
            "tensor a DataLoader worker shares costs a descriptor ('Too many open files').",
            f"ulimit -n {target} before launching (raise the hard limit in "
            "/etc/security/limits.conf or docker --ulimit nofile=65536 if needed).",
        )
    return Check("open files", "ok", detail)


_PTRACE_SCOPES = {
    "0": "classic: any process of the same user may trace or read the ranks",
    "1": "restricted: only ancestors may trace a process; the shm direct path makes each rank traceable by "
    "every process of the same user (PR_SET_PTRACER_ANY) for the rest of its life",
    "2": "admin-only: the shm direct path is refused, and the shm transport copies through its slots",
    "3": "no attach: the shm direct path is refused, and the shm transport copies through its slots",
}


def check_ptrace_scope(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> Check:
    """Yama's ``kernel.yama.ptrace_scope``: whether the shm transport's direct path (process_vm_readv /
    writev between ranks) is possible, and which processes it exposes the ranks' memory to (docs/comm.md)."""
    name = "ptrace_scope"
    try:
        with open(path) as f:
            value = f.read().strip()
    except OSError:
        return Check(name, "ok", "no Yama (kernel.yama.ptrace_scope absent): same-user processes may trace")
    meaning = _PTRACE_SCOPES.get(value, "unknown value")
    return Check(name, "ok", f"kernel.yama.ptrace_scope={value} ({meaning})")


def check_free_port() -> Check:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    except OSError as e:
        return Check(
            "free port",
            "fail",
            f"cannot bind a port on 127.0.0.1: {e}.",
            "check that the loopback interface is up (ip link set lo up).",
        )
    return Check(
        "free port", "ok", f"127.0.0.1:{port} (the kernel picks a free port, as paratrain's launch does)"
    )


def check_hostname(env: Mapping[str, str], ifaces: Interfaces) -> Check:
    host = socket.gethostname()
    addrs = resolve(host)
    if isinstance(addrs, str) or not addrs:
        bound = "GLOO_SOCKET_IFNAME" in env
        return Check(
            "hostname",
            "ok" if bound else "warning",
            f"{host!r} does not resolve ({addrs or 'no address'})"
            + (
                "; GLOO_SOCKET_IFNAME is set, so Gloo does not need it"
                if bound
                else ": Gloo without GLOO_SOCKET_IFNAME cannot pick its address (torchrun, multi-node)"
            ),
            f"add '127.0.1.1 {host}' (or its network address) to /etc/hosts, or set GLOO_SOCKET_IFNAME.",
        )
    loopback = all(a.startswith("127.") or a == "::1" for a in addrs)
    if not loopback:
        via = local_addresses(ifaces).get(addrs[0])
        return Check("hostname", "ok", f"{host} -> {addrs[0]}" + (f" ({via})" if via else ""))
    master = env.get("MASTER_ADDR", "").strip()
    remote = bool(master) and master not in ("localhost",) and not _is_local(master, ifaces)
    if remote and "GLOO_SOCKET_IFNAME" not in env:
        return Check(
            "hostname",
            "warning",
            f"{host} -> {addrs[0]} (loopback) while MASTER_ADDR is another host: Gloo "
            "would listen on loopback, unreachable from the other nodes.",
            "set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface towards the other nodes.",
        )
    return Check(
        "hostname",
        "ok",
        f"{host} -> {addrs[0]} (loopback: fine on one node; a multi-node job sets "
        "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)",
    )


def _is_local(host: str, ifaces: Interfaces) -> bool:
    addrs = resolve(host, timeout_s=2.0)
    mine = local_addresses(ifaces)
    return isinstance(addrs, list) and any(a in mine or a.startswith("127.") or a == "::1" for a in addrs)


# ---- all checks, output, CLI -------------------------------------------------------------------------------


def _safe(name: str, fn: Callable[..., Check], *args: Any) -> Check:
    """``fn(*args)``, or a warning naming the check when the check itself breaks: one odd host must not
    cost the user the other answers."""
    try:
        return fn(*args)
    except Exception as e:
        return Check(
            name, "warning", f"the check itself failed: {type(e).__name__}: {e}", "report this as a bug."
        )


def _safe_list(name: str, fn: Callable[..., list[Check]], *args: Any) -> list[Check]:
    try:
        return fn(*args)
    except Exception as e:
        return [
            Check(
                name, "warning", f"the check itself failed: {type(e).__name__}: {e}", "report this as a bug."
            )
        ]


def default_nproc() -> int:
    """The self-test's ranks: one per GPU, or 2 on CPU (as ``paratrain launch``)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return count or 2


def collect(
    nproc: int | None = None,
    timeout_s: float = 60.0,
    selftest: bool = True,
    env: Mapping[str, str] | None = None,
    spent_s: float = 0.0,
) -> tuple[list[Check], dict[str, Any]]:
    """Run every check; returns them in order, and the self-test's result (``{"ran": False, ...}`` if it
    did not run). ``spent_s``: seconds of ``timeout_s`` already used before the call (the command's
    start-up, :func:`paratrain.procfs.process_age`)."""
    start = time.monotonic() - spent_s
    env = dict(os.environ if env is None else env)
    ifaces = interfaces()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks = [_safe("versions", check_versions), _safe("backends", check_backends, gpus)]
    checks += _safe_list("gpus", check_gpus, env)
    network = [
        _safe("NCCL_SOCKET_IFNAME", check_nccl_ifname, env, ifaces),
        _safe("GLOO_SOCKET_IFNAME", check_gloo_ifname, env, ifaces),
        _safe("NCCL_IB_DISABLE", check_ib_disable, env),
        _safe("MASTER_ADDR", check_master_addr, env, ifaces),
        _safe("MASTER_PORT", check_master_port, env, ifaces),
    ]
    checks += network
    checks += [
        _safe("/dev/shm", check_shm),
        _safe("open files", check_open_files),
        _safe("ptrace_scope", check_ptrace_scope),
        _safe("free port", check_free_port),
        _safe("hostname", check_hostname, env, ifaces),
    ]
    if not selftest:
        return checks, skipped("--no-selftest")
    n = nproc or default_nproc()
    budget = timeout_s - (time.monotonic() - start) - 1.0  # leave a second to kill and report
    broken = [c.name for c in network if c.status == "fail" and c.name.endswith("SOCKET_IFNAME")]
    if broken:
        budget = min(budget, 30.0)  # it will fail at once; show the backend's own error, quickly
    if budget < 5.0:
        result = skipped(f"no time left within --timeout {timeout_s:.0f} s (the checks above took it)")
    else:
        result = run_selftest(n, budget, env)
        if broken:
            result["network_checks_failed"] = broken
    return checks + selftest_checks(result), result


def format_text(checks: list[Check]) -> str:
    return "\n".join(c.line() for c in checks)


def to_json(checks: list[Check], selftest: dict[str, Any]) -> dict[str, Any]:
    return {
        "checks": [c.to_dict() for c in checks],
        "ok": not any(c.status == "fail" for c in checks),
        "selftest": selftest,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``paratrain doctor``."""
    p.add_argument("--json", action="store_true", help="print one JSON object instead of one line per check")
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks of the communication self-test (default: one per GPU, else 2)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds for the whole doctor, self-test included; its job is killed at the deadline "
        "(default 60)",
    )
    p.add_argument("--no-selftest", action="store_true", help="only the static checks (no processes started)")


def run(args: argparse.Namespace) -> int:
    """``paratrain doctor``: print the checks; 1 if any failed, else 0. Raises :class:`ConfigError`."""
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}.")
    if not 0 < args.timeout <= 86400:  # NaN and inf too
        raise ConfigError(
            f"--timeout must be a positive number of seconds (at most a day), got {args.timeout}."
        )
    checks, selftest = collect(
        args.nproc_per_node, args.timeout, selftest=not args.no_selftest, spent_s=process_age()
    )
    if args.json:
        print(json.dumps(to_json(checks, selftest)))
    else:
        print(format_text(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="paratrain doctor", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"paratrain doctor: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
