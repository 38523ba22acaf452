"""The ring's own TCP links: one stream to the right neighbour, one from the left, per Gloo group on one host.

Why the ring has links of its own. On Gloo, a ring made of ``ProcessGroup.send``/``recv`` pays a layer
per message that Gloo's own all-reduce does not: a c10d work object, a Gloo buffer, a notification from
Gloo's I/O thread, and the GIL handed back and forth on every wait. At 16 MB on 4 ranks (24 messages of
2 MiB per call, every rank on two shared cores) that layer was 8-20% of the CPU and kept the ring at
0.84-0.95× Gloo's all-reduce (docs/benchmarks/ring-16mb.md). The bytes were never the problem:
both move them through the same loopback sockets. Here the ring owns two plain sockets per rank, so a
message is one ``send`` on a sender thread and one ``recv_into(..., MSG_WAITALL)`` on the caller's
thread, both without the GIL while the kernel copies.

Why this is safe as a plain stream. The ring's schedule is the same on every rank and fully ordered:
rank r sends its pieces to the right in loop order and the right neighbour receives them from its left
in that same order, sizes known to both sides from the chunk bounds. So no tags and no headers are
needed; a byte stream per direction carries the messages back to back.

- **When.** Created on the first ring call of a Gloo group with a CPU tensor (collective, through the
  group's store, once per group), and only when every rank of the group is on this host (host name and
  boot id agree; the links use 127.0.0.1) and no rank set ``PARATRAIN_RING_LINKS=c10d``. Otherwise the
  ring keeps c10d's point-to-point, as before. Every rank publishes what it can do and all decide the
  same from the same answers, so a group never splits between the two.
- **Sends** go to a queue that a daemon thread drains in order; the caller waits for a send only where
  it must (before the all-gather overwrites memory a send may still read, and at the end of a call).
- **Failures.** A peer that exits or is killed closes its sockets (the kernel does it, SIGKILL
  included): the next ``recv``/``send`` fails at once with an error naming the rank. A peer that hangs is
  named after the group's timeout. Either way the links are closed and the group is no longer usable
  for the ring, like a process group after a timeout.
- **Lifetime.** One :class:`RingLinks` per live group (:func:`links_for`); links of destroyed groups are
  closed on the next lookup, the rest at exit. A forked child (a DataLoader worker) closes its copies of
  the sockets at once, so that it cannot keep a dead rank's connection open.
- **Not thread-safe per group**: like any collective, one ring at a time on a group (paratrain's ``dp``
  runs its ring on one worker thread with a group of its own).
"""

from __future__ import annotations

import atexit
import datetime
import hmac
import json
import logging
import os
import queue
import secrets
import socket
import struct
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm._common import Peers
from paratrain.comm.shm.system import _group_timeout, _host_info

ENV = "PARATRAIN_RING_LINKS"
"""``auto`` (default): the ring's own links where every rank is on one host; ``c10d``: never."""
SLICE_S = 1.0
"""How long one blocking socket call lasts before the caller looks at the deadline and the other side."""
_ACCEPT_S = 60.0
"""How long the handshake waits for a neighbour's connection (it connects right after publishing)."""
_HELLO = struct.Struct("<16sq")  # the group's token and the connecting rank, checked by the acceptor
_HELLO_S = 5.0
"""How long the acceptor waits for a connection's hello (a neighbour sends it right after connecting)."""
log = logging.getLogger("paratrain.comm")


class LinkError(RuntimeError):
    """A ring link failed (a peer exited, was killed, hung or spoke out of turn)."""


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "c10d"):
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r}: expected 'auto' (the ring's own links on one host) or 'c10d'."
        )
    return mode


_NOT_ONE_HOST = "the ranks are not all on one host"


def decide(answers: list[dict[str, Any]]) -> str | None:
    """Why the group cannot use links (``None``: it can), from every rank's published answer."""
    if any(a["mode"] != "auto" for a in answers):
        return f"{ENV}=c10d on rank(s) {[i for i, a in enumerate(answers) if a['mode'] != 'auto']}"
    if any((a["host"], a["boot"]) != (answers[0]["host"], answers[0]["boot"]) for a in answers):
        return _NOT_ONE_HOST
    bad = [f"group rank {i}: {a['error']}" for i, a in enumerate(answers) if a.get("error")]
    return "; ".join(bad) if bad else None


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable (a complex, bf16 or bool tensor is just bytes here)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def _set_timeo(sock: socket.socket, option: int, seconds: float) -> None:
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec, int((seconds - sec) * 1e6)))


class RingLinks:
    """This rank's two streams of a group: ``out`` to the right neighbour, ``inp`` from the left."""

    def __init__(
        self, peers: Peers, out: socket.socket, inp: socket.socket, timeout_s: float, refused: int = 0
    ) -> None:
        self.peers = peers
        self.refused = refused
        """Connections the handshake refused: they did not present the group's token and the left rank."""
        self.right = peers.global_rank((peers.rank + 1) % peers.size)
        self.left = peers.global_rank((peers.rank - 1) % peers.size)
        self.out, self.inp, self.timeout_s = out, inp, timeout_s
        for s in (out, inp):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _set_timeo(inp, socket.SO_RCVTIMEO, SLICE_S)
        _set_timeo(out, socket.SO_SNDTIMEO, SLICE_S)
        self.closed = False
        self.error: BaseException | None = None
        self._queue: queue.SimpleQueue[tuple[int, memoryview, str] | None] = queue.SimpleQueue()
        self._posted = 0
        self._sent = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._sender, name="paratrain-ring-links", daemon=True)
        self._thread.start()

    # -- sending (a daemon thread drains the queue in order) ----------------------------------------
    def send(self, tensor: torch.Tensor, what: str) -> int:
        """Queue ``tensor`` (contiguous, CPU; it must not change until :meth:`wait_sent`); its number."""
        self._check()
        self._posted += 1
        self._queue.put((self._posted, _bytes(tensor), what))
        return self._posted

    def wait_sent(self, seq: int) -> None:
        """Wait until send number ``seq`` (and every earlier one) has been handed to the kernel."""
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while self._sent < seq and self.error is None and not self.closed:
                if time.monotonic() > deadline:
                    self.error = TimeoutError(
                        f"ring: rank {self.right} did not take the bytes this rank sent it within "
                        f"{self.timeout_s:g} s (it is stuck or far behind)."
                    )
                    break
                self._cond.wait(SLICE_S)
        self._check()

    def flush(self) -> None:
        self.wait_sent(self._posted)

    def _sender(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            seq, mv, what = item
            try:
                self._send_all(mv, what)
            except BaseException as e:  # handed to the caller's thread, which raises it
                with self._cond:
                    self.error = self.error or e
                    self._cond.notify_all()
                return
            with self._cond:
                self._sent = seq
                self._cond.notify_all()

    def _send_all(self, mv: memoryview, what: str) -> None:
        done, deadline = 0, time.monotonic() + self.timeout_s
        while done < len(mv):
            if self.closed:
                raise LinkError("ring: the links were closed while a send was in progress.")
            try:
                done += self.out.send(mv[done:])
                deadline = time.monotonic() + self.timeout_s
            except (BlockingIOError, TimeoutError):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ring {what}: rank {self.right} took nothing this rank sent it for {self.timeout_s:g} s "
                        "(it is stuck or far behind)."
                    ) from None
            except OSError as e:
                raise LinkError(
                    f"ring {what}: rank {self.right} closed its link ({e.strerror or e}); it exited or was killed."
                ) from None

    # -- receiving (on the caller's thread) ---------------------------------------------------------
    def recv(self, tensor: torch.Tensor, what: str) -> None:
        """Fill ``tensor`` (contiguous, CPU) with the next ``tensor.nbytes`` bytes from the left."""
        mv = _bytes(tensor)
        done, deadline = 0, time.monotonic() + self.timeout_s
        while done < len(mv):
            self._check()
            try:
                got = self.inp.recv_into(mv[done:], len(mv) - done, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError):
                got = -1
            except OSError as e:
                self._fail(
                    LinkError(
                        f"ring {what}: rank {self.left} closed its link ({e.strerror or e}); it exited or "
                        "was killed."
                    )
                )
            if got == 0:
                self._fail(
                    LinkError(
                        f"ring {what}: rank {self.left} closed its link after {done} of {len(mv)} bytes; it "
                        "exited or was killed."
                    )
                )
            if got > 0:
                done += got
                deadline = time.monotonic() + self.timeout_s
            elif time.monotonic() > deadline:
                self._fail(
                    TimeoutError(
                        f"ring {what}: rank {self.left} sent nothing for {self.timeout_s:g} s (it is stuck, far "
                        "behind, or not in this collective)."
                    )
                )

    # -- failure and closing ------------------------------------------------------------------------
    def _check(self) -> None:
        if self.error is not None:
            self._fail(self.error)
        if self.closed:
            raise LinkError(
                "ring: these links are closed (a peer failed earlier, or the group was destroyed)."
            )

    def _fail(self, error: BaseException) -> None:
        self.error = self.error or error
        self.close()
        raise self.error

    def close(self) -> None:
        """Close both streams (idempotent); a sender blocked in the kernel wakes up and stops."""
        if self.closed:
            return
        self.closed = True
        self._queue.put(None)
        for s in (self.out, self.inp):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * SLICE_S)


# ---------------------------------------------------------------------------------------------------
# one RingLinks per live group: the collective set-up through the group's store


class _Entry:
    """One group's slot in the cache: the links, once the group's ranks have decided (``None``: c10d)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg  # held, so that id(pg) stays unique while the entry lives
        self.lock = threading.Lock()
        self.decided = False
        self.links: RingLinks | None = None


_LOCK = threading.Lock()
"""Guards the cache itself; a group's set-up holds only its own entry's lock, so two groups set up on two
threads at once cannot wait on each other across ranks."""
_CACHE: dict[int, _Entry] = {}
"""id(process group) → its entry."""
_INSTANCES: dict[str, int] = {}


def links_for(peers: Peers) -> RingLinks | None:
    """The links of ``peers``' group, created on the first call (collective); ``None``: use c10d p2p."""
    pg = peers.pg
    if pg is None or peers.batched or peers.size < 2:
        return None
    with _LOCK:
        live = dist.distributed_c10d._world.pg_map
        for key, old in list(_CACHE.items()):
            if old.pg not in live:
                if old.links is not None:
                    old.links.close()
                del _CACHE[key]
        entry = _CACHE.get(id(pg))
        if entry is None or entry.pg is not pg:
            entry = _CACHE[id(pg)] = _Entry(pg)
    with entry.lock:
        if not entry.decided:
            entry.links = _connect(peers)
            entry.decided = True
    if entry.links is not None and entry.links.closed:
        entry.links._check()  # raises the failure that closed them
    return entry.links


def close_all() -> None:
    """Close every group's links (registered with ``atexit``)."""
    with _LOCK:
        for entry in _CACHE.values():
            if entry.links is not None:
                entry.links.close()
        _CACHE.clear()


atexit.register(close_all)


def _forget_in_child() -> None:
    """After ``fork`` (a DataLoader worker, say), the child drops its copies of the sockets.

    Otherwise a copy keeps a connection open after the rank itself dies, and its neighbour, which should
    see the connection close at once, waits for the group's timeout instead. Only the child's file
    descriptors are closed, never ``shutdown``, which would end the parent's connection too. The child
    has no sender thread and no use for the links; it starts with an empty cache and a fresh lock."""
    global _LOCK
    for entry in _CACHE.values():
        if entry.links is not None:
            entry.links.out.close()
            entry.links.inp.close()
    _CACHE.clear()
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def _connect(peers: Peers) -> RingLinks | None:
    """The handshake, under ``paratrain-ring/<instance>/`` in the group's store:

    1. every rank binds a listening socket on 127.0.0.1 (unless it is told not to) and publishes its
       mode, host, port and any error as ``offer/<r>``; all read all and decide the same (:func:`decide`);
    2. each rank connects to its right neighbour's port and says who it is (16 random bytes rank 0 put in
       the group's store, which only the group's members read, and its group rank); it accepts connections
       until one presents that token and its left neighbour's rank, closing and counting any other (another
       local process that connected first cannot switch the links off);
    3. every rank publishes ``linked/<r>`` (``ok`` or why not); any failure: all close, all use c10d, and
       group rank 0 logs once why (a warning, or INFO where the user asked for c10d or the group spans
       hosts).
    """
    pg, n, r = peers.pg, peers.size, peers.rank
    timeout_s = _group_timeout(pg)
    name, store = _handshake_store(pg)
    listener, offer = _listen(_mode())
    if r == 0:
        store.set("token", secrets.token_hex(_HELLO.size - 8))  # 16 random bytes: only members read the store
    store.set(f"offer/{r}", json.dumps(offer))
    answers = [
        json.loads(v) for v in _gather(store, "offer", n, peers, timeout_s, "the ring links' handshake")
    ]
    why = decide(answers)
    out = inp = None
    refused = 0
    status = "ok"
    if why is None:
        assert listener is not None
        out, inp, refused, status = _link_neighbours(listener, store, answers, peers, timeout_s)
    if listener is not None:
        listener.close()
    if why is None:
        store.set(f"linked/{r}", status)
        statuses = _gather(store, "linked", n, peers, timeout_s, "the ring links' handshake")
        bad = [f"group rank {i}: {s}" for i, s in enumerate(statuses) if s != "ok"]
        why = "; ".join(bad) or None
    if refused:  # on the rank that saw it
        log.warning(
            "ring links of group %s: group rank %d refused %d connection(s) that did not present the group's "
            "token and its left neighbour's rank (another local process connected to its port)",
            name,
            r,
            refused,
        )
    if why is not None or out is None or inp is None:
        _fall_back(out, inp, r, name, why)
        return None
    return RingLinks(peers, out, inp, timeout_s, refused)


def _handshake_store(pg: Any) -> tuple[str, Any]:
    """The group's name and a fresh ``paratrain-ring/<instance>/`` store of its own for this handshake."""
    name = str(dist.distributed_c10d._get_process_group_name(pg))
    instance = _INSTANCES.get(name, 0)
    _INSTANCES[name] = instance + 1
    try:
        base = dist.distributed_c10d._get_process_group_store(pg)
    except Exception:
        base = dist.PrefixStore(f"group/{name}", dist.distributed_c10d._get_default_store())
    return name, dist.PrefixStore(f"paratrain-ring/{instance}", base)


def _listen(mode: str) -> tuple[socket.socket | None, dict[str, Any]]:
    """This rank's listening socket on 127.0.0.1 (``auto`` only) and the offer it publishes."""
    listener: socket.socket | None = None
    offer: dict[str, Any] = {"mode": mode, **_host_info(), "port": 0, "error": ""}
    if mode == "auto":
        try:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(2)
            offer["port"] = listener.getsockname()[1]
        except OSError as e:
            offer["error"] = f"cannot listen on 127.0.0.1: {e}"
    return listener, offer


def _link_neighbours(
    listener: socket.socket, store: Any, answers: list[dict[str, Any]], peers: Peers, timeout_s: float
) -> tuple[socket.socket | None, socket.socket | None, int, str]:
    """Connect to the right neighbour and accept the left one: the two sockets, the connections refused,
    and ``ok`` or why not."""
    n, r = peers.size, peers.rank
    token = bytes.fromhex(_gather(store, "token", 0, peers, timeout_s, "the ring links' token")[0])
    right, left = (r + 1) % n, (r - 1) % n
    out = None
    status = "ok"
    try:  # a failed connect still accepts, so that the right neighbour of this rank is not left waiting
        out = socket.create_connection(("127.0.0.1", answers[right]["port"]), timeout=_ACCEPT_S)
        out.sendall(_HELLO.pack(token, r))
    except OSError as e:
        status = f"could not connect to group rank {right}: {e}"
    inp, refused, problem = _accept_left(listener, token, left)
    for s in (out, inp):
        if s is not None:
            s.settimeout(None)
    return out, inp, refused, problem or status


def _fall_back(
    out: socket.socket | None, inp: socket.socket | None, r: int, name: str, why: str | None
) -> None:
    """Close what was opened; group rank 0 logs once why the group uses c10d (every rank decided the same)."""
    for s in (out, inp):
        if s is not None:
            s.close()
    if r == 0:
        user = why is not None and why.startswith(f"{ENV}=c10d")
        (log.info if user or why == _NOT_ONE_HOST else log.warning)(
            "ring of group %s: uses c10d's point-to-point, not its own TCP links: %s",
            name,
            why or "the handshake failed",
        )


def _accept_left(listener: socket.socket, token: bytes, left: int) -> tuple[socket.socket | None, int, str]:
    """The connection of group rank ``left``, which presents the group's ``token`` and its rank; any other
    (a local process that connected first, or spoke garbage) is closed and counted, and accepting goes on
    until ``_ACCEPT_S`` has passed. Returns ``(connection or None, refused, problem or "")``."""
    deadline = time.monotonic() + _ACCEPT_S
    refused = 0
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return (
                None,
                refused,
                f"no connection from group rank {left} in {_ACCEPT_S:g} s ({refused} refused)",
            )
        try:
            listener.settimeout(left_s)
            conn, _ = listener.accept()
        except OSError as e:
            return None, refused, f"no connection from group rank {left}: {e} ({refused} refused)"
        try:
            conn.settimeout(min(_HELLO_S, left_s))
            got_token, got_rank = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
        except (OSError, struct.error):
            got_token, got_rank = b"", -1
        if hmac.compare_digest(got_token, token) and got_rank == left:
            return conn, refused, ""
        conn.close()
        refused += 1


def _recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    data = b""
    while len(data) < nbytes:
        more = sock.recv(nbytes - len(data))
        if not more:
            raise ConnectionError("the peer closed the connection during the handshake")
        data += more
    return data


def _gather(store: Any, key: str, n: int, peers: Peers, timeout_s: float, what: str) -> list[str]:
    """``key/0..n-1`` (``n`` = 0: ``key`` alone) from the store, or a TimeoutError naming the late ranks."""
    keys = [f"{key}/{i}" for i in range(n)] if n else [key]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:
        late = [peers.global_rank(i) for i, k in enumerate(keys) if not store.check([k])]
        raise TimeoutError(f"{what}: rank(s) {late} did not answer within {timeout_s:g} s.") from None
    return [store.get(k).decode() for k in keys]
