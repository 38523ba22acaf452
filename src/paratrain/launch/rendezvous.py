"""Rendezvous: the c10d settings, a loopback-only store for single-node jobs, free-port checks.

Reference: https://pytorch.org/docs/stable/elastic/rendezvous.html
"""

from __future__ import annotations

import socket
from typing import Any

from paratrain.config import LaunchConfig
from paratrain.errors import ConfigError


def port_in_use(host: str, port: int) -> bool:
    """Whether ``port`` cannot be bound on ``host`` (``""``: every interface, as a TCPStore listens): the one
    port probe of the launcher's preflight and ``paratrain doctor``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def is_standalone(launch: LaunchConfig) -> bool:
    return launch.rdzv_endpoint is None and launch.nnodes == "1"


def is_loopback_job(launch: LaunchConfig) -> bool:
    """A job whose every rank runs on this machine: standalone, or a loopback ``--rdzv-endpoint``."""
    if launch.rdzv_endpoint is None:
        return launch.nnodes == "1"
    host, _ = launch.rdzv_endpoint.rpartition(":")[::2]
    return is_loopback_host(host)


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


def is_loopback_host(host: str) -> bool:
    """``127.0.0.0/8``, ``::1`` or ``localhost``: an endpoint only this machine can reach."""
    import ipaddress

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else 0


def _create_loopback_handler(params: Any) -> Any:
    """The c10d rendezvous of a job on one machine, with every store listening on loopback only.

    ``TCPStore(host, ...)`` listens on *every* interface whatever ``host`` says (verified on torch 2.13 with
    ``ss -ltn``: ``*:PORT``), so a job on one machine would expose its store to the network. Here paratrain
    binds the listening socket itself to the loopback address and hands it to the store
    (``master_listen_fd``); the rest is torch's own dynamic rendezvous handler. Used by standalone jobs and
    by several agents on one machine that name a loopback ``--rdzv-endpoint`` (``is_host`` picks the one
    that serves the store; the others connect to it).
    """
    import datetime

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    host, port = split_endpoint(params.endpoint) if params.endpoint else ("127.0.0.1", 0)
    v6 = ":" in host
    address = "::1" if v6 else "127.0.0.1"
    timeout = datetime.timedelta(seconds=int(params.get_as_int("read_timeout", 60) or 60))

    def loopback_store(port: int) -> TCPStore:
        sock = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))  # port 0: the kernel picks a free port atomically
        sock.listen(512)
        return TCPStore(
            address,
            sock.getsockname()[1],
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            master_listen_fd=sock.detach(),  # the store owns the descriptor from now on
            timeout=timeout,
        )

    if params.get_as_bool("is_host", True):
        store = loopback_store(port)
    else:  # another agent on this machine serves the store
        store = TCPStore(address, port, is_master=False, multi_tenant=True, timeout=timeout)

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
