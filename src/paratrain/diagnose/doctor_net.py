"""``paratrain doctor``'s network checks: the rendezvous and socket variables torch.distributed reads, against this host's interfaces.

- ``NCCL_SOCKET_IFNAME``: NCCL's syntax (``findInterfaces`` in NCCL's ``socket.cc``): a comma-separated list
  of interface-name *prefixes*; a leading ``^`` excludes the listed prefixes instead, a leading ``=`` (after
  the ``^``, if any) makes the names exact. The prefixes apply to the whole list, as NCCL reads it, so
  ``^docker,lo`` excludes both ``docker*`` and ``lo*``. An item may end in ``:PORT`` (ignored here). NCCL only
  uses interfaces that have an address.
- ``GLOO_SOCKET_IFNAME``: Gloo's syntax (``ProcessGroupGloo``): a comma-separated list of *exact* names,
  one Gloo device per name, each of which must have an address ("Unable to find address for: X" otherwise).
- ``NCCL_IB_DISABLE``: ``0`` or ``1``.
- ``MASTER_ADDR``: resolves (bounded by a timeout: a dead DNS server must not hang the doctor), and is either
  this host or another host with a route to it.
- ``MASTER_PORT``: a port number, free on this host when this host is the master.

Every check is a pure function of an environment mapping and an :data:`Interfaces` mapping, so that tests
can pass made-up hosts.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from paratrain.errors import ConfigError
from paratrain.launch.rendezvous import port_in_use

Status = Literal["ok", "warning", "fail"]
Interfaces = Mapping[str, list[str]]
"""Interface name -> its addresses (IPv4 and IPv6 as text); an interface without an address maps to []."""

_SIOCGIFADDR = 0x8915  # linux/sockios.h: get the interface's (primary) IPv4 address


@dataclass(frozen=True)
class Check:
    """One line of ``paratrain doctor``: what was checked, how it went, and the fix when it is not ok."""

    name: str
    status: Status
    detail: str
    fix: str = ""

    def line(self) -> str:
        label = {"ok": "ok", "warning": "warning", "fail": "FAIL"}[self.status]
        text = f"{label:<8}{self.name}: {self.detail}"
        if self.fix and self.status != "ok":
            text += f" fix: {self.fix}"
        return text

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix}


# ---- this host's interfaces ----------------------------------------------------------------------------


def _ipv4_address(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None  # no IPv4 address (EADDRNOTAVAIL), or the interface vanished
    return socket.inet_ntoa(packed[20:24])


def _ipv6_addresses() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()  # address ifindex prefixlen scope flags name
                if len(parts) == 6:
                    addr = ipaddress.IPv6Address(bytes.fromhex(parts[0]))
                    out.setdefault(parts[5], []).append(str(addr))
    except OSError:
        pass
    return out


def interfaces() -> dict[str, list[str]]:
    """This host's interfaces and addresses: names from ``socket.if_nameindex()``, IPv4 addresses by the
    ``SIOCGIFADDR`` ioctl and IPv6 ones from ``/proc/net/if_inet6`` (Linux; elsewhere names only)."""
    names = [name for _, name in socket.if_nameindex()]
    if not sys.platform.startswith("linux"):
        return {name: [] for name in names}
    v6 = _ipv6_addresses()
    out: dict[str, list[str]] = {}
    for name in names:
        v4 = _ipv4_address(name)
        out[name] = ([v4] if v4 else []) + v6.get(name, [])
    return out


def _describe(ifaces: Interfaces) -> str:
    parts = [f"{n} ({', '.join(a) if a else 'no address'})" for n, a in ifaces.items()]
    return ", ".join(parts) or "none"


def _is_loopback(name: str, ifaces: Interfaces) -> bool:
    addrs = ifaces.get(name, [])
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


# ---- NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME ----------------------------------------------------------


@dataclass(frozen=True)
class IfnameSpec:
    """A parsed ``NCCL_SOCKET_IFNAME``."""

    names: tuple[str, ...]
    exclude: bool = False
    """``^``: use every interface *except* those matching."""
    exact: bool = False
    """``=``: the names are whole interface names, not prefixes."""

    def matches(self, interface: str, name: str | None = None) -> bool:
        """Whether ``interface`` matches ``name`` (default: any of the names), before ``exclude``."""
        names = self.names if name is None else (name,)
        return any(interface == n if self.exact else interface.startswith(n) for n in names)

    def select(self, available: list[str]) -> list[str]:
        """The interfaces NCCL would consider, in ``available``'s order."""
        return [i for i in available if self.matches(i) != self.exclude]


def parse_nccl_ifname(value: str) -> IfnameSpec:
    """``"^=docker0,lo"`` -> ``IfnameSpec(("docker0", "lo"), exclude=True, exact=True)``; ``:PORT`` suffixes
    are dropped and empty items skipped."""
    text = value.strip()
    exclude = text.startswith("^")
    if exclude:
        text = text[1:]
    exact = text.startswith("=")
    if exact:
        text = text[1:]
    names = tuple(item.split(":", 1)[0].strip() for item in text.split(","))
    return IfnameSpec(tuple(n for n in names if n), exclude, exact)


def check_nccl_ifname(env: Mapping[str, str], ifaces: Interfaces) -> Check:
    name = "NCCL_SOCKET_IFNAME"
    value = env.get(name)
    if value is None:
        return Check(name, "ok", "not set (NCCL picks an interface itself, skipping lo and docker*)")
    spec = parse_nccl_ifname(value)
    have = f"this host has {_describe(ifaces)}"
    if not spec.names:
        return Check(name, "fail", f"{name}={value!r} names no interface; {have}.", _ifname_fix(name, ifaces))
    selected = spec.select(list(ifaces))
    usable = [i for i in selected if ifaces[i]]
    how = ("all but " if spec.exclude else "") + ("exactly " if spec.exact else "names starting with ")
    meaning = f"{name}={value!r} ({how}{', '.join(spec.names)})"
    if not usable:
        picked = f" (matches {', '.join(selected)}, without an address)" if selected else ""
        return Check(
            name,
            "fail",
            f"{meaning} leaves NCCL no interface with an address{picked}; {have}.",
            _ifname_fix(name, ifaces),
        )
    unmatched = [n for n in spec.names if not spec.exclude and not any(spec.matches(i, n) for i in ifaces)]
    if unmatched:
        return Check(
            name,
            "warning",
            f"{meaning}: {', '.join(unmatched)} matches no interface here; NCCL uses "
            f"{', '.join(usable)}; {have}.",
            f"remove {', '.join(unmatched)} from {name}.",
        )
    return Check(name, "ok", f"{meaning} -> NCCL uses {', '.join(usable)}")


def _ifname_fix(var: str, ifaces: Interfaces) -> str:
    good = [n for n, a in ifaces.items() if a and not _is_loopback(n, ifaces)]
    example = good[0] if good else next((n for n, a in ifaces.items() if a), "lo")
    return (
        f"set {var} to the interface that reaches the other nodes (here e.g. {var}={example}; "
        f"'ip -o addr' lists them), or unset it."
    )


def check_gloo_ifname(env: Mapping[str, str], ifaces: Interfaces) -> Check:
    name = "GLOO_SOCKET_IFNAME"
    value = env.get(name)
    if value is None:
        return Check(
            name,
            "ok",
            "not set (Gloo listens on the address the hostname resolves to; paratrain's "
            "single-node launch uses lo)",
        )
    have = f"this host has {_describe(ifaces)}"
    names = [n.strip() for n in value.split(",")]
    if not all(names) or any(n.startswith(("^", "=")) for n in names):
        return Check(
            name,
            "fail",
            f"{name}={value!r}: Gloo takes exact interface names separated by commas (no "
            f"empty items, no NCCL-style ^ or = prefix); {have}.",
            _ifname_fix(name, ifaces),
        )
    missing = [n for n in names if n not in ifaces]
    if missing:
        return Check(
            name,
            "fail",
            f"{name}={value!r}: no interface named {', '.join(missing)} on this host "
            f"(Gloo fails with 'Unable to find address for: {missing[0]}'); {have}.",
            _ifname_fix(name, ifaces),
        )
    bare = [n for n in names if not ifaces[n]]
    if bare:
        return Check(
            name,
            "fail",
            f"{name}={value!r}: {', '.join(bare)} has no address, so Gloo cannot listen on it; {have}.",
            _ifname_fix(name, ifaces),
        )
    return Check(name, "ok", f"{name}={value} -> Gloo uses {_describe({n: ifaces[n] for n in names})}")


def preflight_ifname(env: Mapping[str, str] | None = None) -> None:
    """``paratrain train``/``launch``: doctor's diagnosis of a ``GLOO_SOCKET_IFNAME`` that Gloo cannot use, as
    one :class:`ConfigError` before any worker starts (Gloo's own error comes once per rank, from C++)."""
    env = os.environ if env is None else env
    if env.get("GLOO_SOCKET_IFNAME") is None:
        return
    check = check_gloo_ifname(env, interfaces())
    if check.status == "fail":
        raise ConfigError(f"{check.detail} Fix: {check.fix} (`paratrain doctor` checks the whole setup.)")


# ---- NCCL_IB_DISABLE ------------------------------------------------------------------------------------


def check_ib_disable(env: Mapping[str, str]) -> Check:
    name = "NCCL_IB_DISABLE"
    value = env.get(name)
    ib = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else []
    has = f"InfiniBand devices here: {', '.join(ib) if ib else 'none'}"
    if value is None:
        return Check(name, "ok", f"not set (NCCL uses InfiniBand when present); {has}")
    if value.strip() not in ("0", "1"):
        return Check(
            name,
            "fail",
            f"{name}={value!r} is neither 0 nor 1; {has}.",
            "set NCCL_IB_DISABLE=1 to force sockets (multi-node over Ethernet), 0 to allow InfiniBand, or "
            "unset it.",
        )
    if value.strip() == "0" and not ib:
        return Check(name, "ok", f"{name}=0 but no InfiniBand device: NCCL falls back to sockets; {has}")
    return Check(name, "ok", f"{name}={value.strip()}; {has}")


# ---- MASTER_ADDR / MASTER_PORT --------------------------------------------------------------------------


def resolve(host: str, timeout_s: float = 3.0) -> list[str] | str:
    """The addresses ``host`` resolves to, or an error message; a resolver that takes longer than
    ``timeout_s`` counts as an error (``getaddrinfo`` has no timeout of its own, so it runs in a thread)."""
    box: list[list[str] | str] = []

    def work() -> None:
        try:
            infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            box.append(list(dict.fromkeys(str(info[4][0]) for info in infos)))
        except (OSError, UnicodeError) as e:
            box.append(str(e))

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else f"name resolution took longer than {timeout_s:.0f} s"


def local_addresses(ifaces: Interfaces) -> dict[str, str]:
    """Address -> interface name for every address of this host."""
    return {a.split("%")[0]: name for name, addrs in ifaces.items() for a in addrs}


def _route_interface(addr: str, ifaces: Interfaces) -> str | None:
    """The local interface the kernel would send to ``addr`` through (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, 9))
        source = str(s.getsockname()[0])
    return local_addresses(ifaces).get(source, source)


def check_master_addr(env: Mapping[str, str], ifaces: Interfaces) -> Check:
    name = "MASTER_ADDR"
    value = env.get(name)
    if value is None:
        return Check(
            name,
            "ok",
            "not set (torchrun and paratrain set it for each worker; a single-node "
            "paratrain job uses 127.0.0.1)",
        )
    fix = (
        "set MASTER_ADDR to rank 0's node: its IP address, or a name every node resolves (DNS or /etc/hosts)."
    )
    addrs = resolve(value.strip())
    if isinstance(addrs, str) or not addrs:
        return Check(name, "fail", f"{name}={value!r} does not resolve ({addrs or 'no address'}).", fix)
    mine = local_addresses(ifaces)
    here = [a for a in addrs if a in mine or ipaddress.ip_address(a).is_loopback]
    if here:
        return Check(name, "ok", f"{name}={value} -> {here[0]}: this host ({mine.get(here[0], 'loopback')})")
    try:
        via = _route_interface(addrs[0], ifaces)
    except OSError as e:
        return Check(
            name,
            "fail",
            f"{name}={value} -> {addrs[0]}: no route from this host ({e.strerror}).",
            f"check the network between the nodes (ping {addrs[0]}), or {fix[0].lower()}{fix[1:]}",
        )
    detail = f"{name}={value} -> {addrs[0]}: another host, reached through {via}"
    loop_only = [
        v for v in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if _only_loopback(v, env.get(v), ifaces)
    ]
    if loop_only:
        return Check(
            name,
            "warning",
            f"{detail}, but {' and '.join(loop_only)} {'select' if len(loop_only) > 1 else 'selects'} only "
            "loopback: peers on other nodes cannot reach this one.",
            f"set {loop_only[0]}={via} (the interface towards MASTER_ADDR).",
        )
    port = parse_port(env.get("MASTER_PORT", ""))
    if isinstance(port, int):
        detail += "; " + _probe(addrs[0], port)
    return Check(name, "ok", detail)


def selected_interfaces(var: str, value: str, ifaces: Interfaces) -> list[str]:
    """The interfaces with an address that ``var=value`` makes the backend use on this host."""
    if var == "GLOO_SOCKET_IFNAME":
        names = [n.strip() for n in value.split(",")]
    else:
        names = parse_nccl_ifname(value).select(list(ifaces))
    return [n for n in names if ifaces.get(n)]


def _only_loopback(var: str, value: str | None, ifaces: Interfaces) -> bool:
    used = selected_interfaces(var, value, ifaces) if value else []
    return bool(used) and all(_is_loopback(n, ifaces) for n in used)


def _probe(addr: str, port: int) -> str:
    try:
        with socket.create_connection((addr, port), timeout=2.0):
            return f"port {port} accepts connections"
    except TimeoutError:
        return f"a connection to port {port} timed out (a firewall? or rank 0 not started yet)"
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            return f"nothing listens on port {port} yet (normal before rank 0 starts)"
        return f"port {port}: {e.strerror or e}"


def parse_port(value: str) -> int | str:
    """``"29500"`` -> 29500; anything that is not a port in 1..65535 -> an error message."""
    text = value.strip()
    if not text.isdigit():
        return f"{value!r} is not a port number"
    port = int(text)
    return port if 0 < port < 65536 else f"{port} is outside 1..65535"


def check_master_port(env: Mapping[str, str], ifaces: Interfaces) -> Check:
    name = "MASTER_PORT"
    value = env.get(name)
    if value is None:
        return Check(
            name, "ok", "not set (torchrun and paratrain pick one; paratrain's default is a free port)"
        )
    port = parse_port(value)
    if isinstance(port, str):
        return Check(
            name,
            "fail",
            f"{name}={port}.",
            "set MASTER_PORT to a free TCP port in 1024..65535 (e.g. 29500), or unset it.",
        )
    if port < 1024 and os.geteuid() != 0:
        return Check(
            name,
            "warning",
            f"{name}={port} is a privileged port: only root may listen on it.",
            "use a port in 1024..65535, e.g. 29500.",
        )
    addr = env.get("MASTER_ADDR", "127.0.0.1").strip()
    resolved = resolve(addr, timeout_s=2.0)
    mine = local_addresses(ifaces)
    is_here = isinstance(resolved, list) and any(
        a in mine or ipaddress.ip_address(a).is_loopback for a in resolved
    )
    in_job = "TORCHELASTIC_RUN_ID" in env or "RANK" in env  # inside a job the store owns the port
    if is_here and not in_job and port_in_use("", port):
        return Check(
            name,
            "fail",
            f"{name}={port} is already in use on this host (another job, or a stale one).",
            f"pick another port, or find the owner with: ss -ltnp 'sport = :{port}'",
        )
    where = "free on this host" if is_here and not in_job else "not tested: rank 0's host listens on it"
    return Check(name, "ok", f"{name}={port}: {where}")
