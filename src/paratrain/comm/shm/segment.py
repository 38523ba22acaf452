"""A shared-memory segment of one process group: creation handshake, mapping, flags, waiting, arena.

:class:`_Segment` is the base of :class:`paratrain.comm.shm.ShmCommunicator`; it owns everything except
the collectives themselves. The layout, the protocol and the cleanup strategy are described in
:mod:`paratrain.comm.shm`'s docstring.
"""

from __future__ import annotations

import datetime
import json
import mmap
import os
import platform
import secrets
import threading
import weakref
from typing import Any, Self

import numpy as np
import torch
import torch.distributed as dist

from paratrain.comm._common import Peers, peers
from paratrain.comm.shm.system import (
    _ALIGN,
    _FENCE,
    _FUTEX,
    _PAGE,
    _VM,
    SEGMENT_PREFIX,
    _align,
    _Futex,
    _group_timeout,
    _host_info,
    _job_id,
    _pid_namespace,
    _slug,
    _start_time,
    _sweep_stale,
    _unlink,
    _VmReader,
)
from paratrain.comm.shm.tune import FUNCTIONS as TUNED_FUNCTIONS
from paratrain.comm.shm.tune import PathTuner

DEFAULT_CAPACITY_BYTES = 8 << 20
"""Bytes of one slot: the largest piece a rank contributes per step (two buffers are kept). 8 MiB keeps a
step's slots of 4 ranks (32 MiB) inside a 48 MiB L3 while a step's two barriers stay small next to the
copies; ``benchmarks/bench_shm.py --capacity`` measures other choices."""
SMALL_BYTES = 64 << 10
"""all_reduce pieces up to this size are reduced by every rank (one barrier instead of two)."""
DIRECT_MIN_BYTES = 256 << 10
"""Tensors above this size may take the direct path (cross-memory attach) when it is available; smaller
ones go through the slots, where a call needs fewer barriers. With tuning (the default) the path above it
is measured (:mod:`.tune`); this and ``OVERSUBSCRIBED_DIRECT_MIN_BYTES`` are the static rule, used
without tuning and for the one call of a size class between the trials and the choice."""
OVERSUBSCRIBED_DIRECT_MIN_BYTES = 2 << 20
"""The direct path's threshold when the group has more ranks than the host has cores. In the 4-rank sweeps
on a 2-core host (``benchmarks/bench_shm.py``: ``results/shm.json`` and the earlier
``results/shm_fixed_order.json``) the direct path was level with the slots from 4 MB to 16 MB (1.89x
against 1.90x Gloo at 4 MB, 2.11x against 2.02x at 16 MB; 2.39x against 2.72x and 1.94x against 1.87x in
the earlier sweep) and ahead from 64 MB (2.46x against 1.97x, 2.52x against 1.57x at 256 MB). (Before the
direct all-reduce wrote its results into the peers it needed a third barrier, and this threshold was
32 MiB.)"""
DIRECT_BLOCK_BYTES = 1 << 20
"""The direct reduction reads the peers' blocks into a private buffer that stays in cache, then reduces
them into this rank's block: the n−1 peer blocks take this many bytes together (1 MiB per peer at 2 ranks,
341 KiB at 4). ``benchmarks/bench_shm_block.py`` (``results/shm_block.json``, 2 runs at 4/16/64 MB)
measured 1 and 1.5 MiB level (3.1-3.5x Gloo at 2 ranks, 2.0-2.4x at 4), 768 KiB about as fast, and
512 KiB behind (2.4-3.2x and 1.9-2.1x)."""
IN_PLACE_BLOCK_BYTES = 1 << 20
"""The zero-copy all-reduce reduces a rank's chunk in place, this many bytes per torch op, so that the
``mean``'s division finds the block still in cache."""

_LINE_WORDS = 32  # 256 bytes of header per rank
_ARRIVE, _REDUCED, _DONE, _STATUS, _PID, _START = 0, 1, 2, 3, 4, 5
_SIG, _SIG_WORDS = 8, 8  # two signatures (one per buffer parity) at words 8..15 and 16..23
_ADDR = 24  # direct path: the address of this rank's tensor for the current call
_TUNE = 25  # words 25..28 of rank 0's line: the paths it chose, one word per collective (tune.py)
_OK, _CLOSED, _ABORTED = 0, 1, 2
_MAGIC, _VERSION = 0x7061726153484D31, 1  # "paraSHM1"
_HEAD_WORDS = 8  # magic, version, size, capacity, arena, nonce, total bytes, reserved
_STEP = {_ARRIVE: "input", _REDUCED: "reduced chunk", _DONE: "final copy"}

_INSTANCES: dict[str, int] = {}
"""Per group name, how many communicators this process has created (keys of the creation handshake)."""
_MAPPED: weakref.WeakSet[_Segment] = weakref.WeakSet()
"""Every communicator of this process with a mapped segment (:func:`transport_storages`)."""


class _Segment:
    """The segment, its flags and its arena; :class:`~paratrain.comm.shm.communicator.ShmCommunicator` adds the
    collectives (its docstring lists the arguments)."""

    def __init__(
        self,
        group: Any = None,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        timeout_s: float | None = None,
        *,
        arena_bytes: int = 0,
        small_bytes: int = SMALL_BYTES,
        futex: bool = True,
        direct: bool = True,
        direct_min_bytes: int | None = None,
        direct_block_bytes: int = DIRECT_BLOCK_BYTES,
        tune: bool | None = None,
        store: Any = None,
        shm_dir: str = "/dev/shm",
    ) -> None:
        if capacity_bytes < 1 or arena_bytes < 0:
            raise ValueError(
                f"shm: capacity_bytes must be >= 1 and arena_bytes >= 0, got {capacity_bytes}, {arena_bytes}."
            )
        self.peers: Peers = peers("shm", group)
        self.group = group
        self.rank, self.size = self.peers.rank, self.peers.size
        self.capacity_bytes = _align(max(capacity_bytes, _ALIGN * self.size))
        self.arena_bytes = _align(arena_bytes)
        self.small_bytes = small_bytes
        self.timeout_s = float(timeout_s) if timeout_s is not None else _group_timeout(self.peers.pg)
        self.name = ""
        self.closed = False
        self._seq = 0
        self._calls = 0
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._arena_used = 0
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._mm: mmap.mmap | None = None
        self._u8 = torch.empty(0, dtype=torch.uint8)
        self._lines = np.zeros((self.size, _LINE_WORDS), dtype=np.int64)
        self._head = np.zeros(_HEAD_WORDS, dtype=np.int64)
        self._pid_ns = _pid_namespace()
        self._same_pidns = False
        self._use_futex = futex
        self._futex: _Futex | None = None
        self._lines_addr = 0
        self.direct = False
        self.tune = direct_min_bytes is None if tune is None else tune
        if direct_min_bytes is None:
            oversubscribed = self.size > (os.cpu_count() or 1)  # the same on every rank of one host
            direct_min_bytes = OVERSUBSCRIBED_DIRECT_MIN_BYTES if oversubscribed else DIRECT_MIN_BYTES
        self.direct_min_bytes = direct_min_bytes
        self._tuner: PathTuner | None = None
        self.direct_block_bytes = max(_ALIGN, direct_block_bytes)
        self._vm: _VmReader | None = None
        self._pids: list[int] = []
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self.trace: list[tuple[float, ...]] | None = None
        """Set to a list to record each direct all-reduce's phases: wall clock at entry, past the ARRIVE
        barrier, after this rank's chunk, past DONE; then this thread's CPU seconds in the ARRIVE wait and
        in the chunk (``benchmarks/bench_shm_phases.py``). ``None``: nothing recorded."""
        if self.size == 1:
            return
        if _FENCE is None:
            raise RuntimeError(
                f"shm: no memory fence available on {platform.machine()} (libatomic not found); the shared-"
                "memory transport needs one outside x86. Install libatomic1 or use another algorithm."
            )
        if not os.path.isdir(shm_dir):
            raise RuntimeError(
                f"shm: {shm_dir} does not exist; the shared-memory transport needs a tmpfs such as Linux's "
                "/dev/shm (pass shm_dir=...), or use another algorithm."
            )
        n, cap = self.size, self.capacity_bytes
        self._head_bytes = _align((_HEAD_WORDS + n * _LINE_WORDS) * 8, _PAGE)
        self._slot_off = self._head_bytes
        self._res_off = self._slot_off + 2 * n * cap
        self._arena_off = _align(self._res_off + 2 * cap, _PAGE)
        self._total = _align(self._arena_off + n * self.arena_bytes, _PAGE)
        self._attach(store, shm_dir, direct)

    # -- creation ------------------------------------------------------------------------------------

    def _attach(self, store: Any, shm_dir: str, direct: bool) -> None:
        """The creation handshake through the store (keys under ``paratrain-shm/<instance>/``):

        1. rank 0 creates and sizes the segment, writes the header, publishes ``name``;
        2. every rank publishes ``host/<r>`` and waits for all of them: different hosts → ``ValueError``;
        3. every rank maps the segment, checks the header, publishes ``attached/<r>`` (``ok`` or why not);
        4. every rank waits for all ``attached`` keys, then the name is unlinked (by whoever comes first).
        """
        pg = self.peers.pg
        group_name = str(dist.distributed_c10d._get_process_group_name(pg))
        instance = _INSTANCES.get(group_name, 0)
        _INSTANCES[group_name] = instance + 1
        if store is None:
            try:
                store = dist.distributed_c10d._get_process_group_store(pg)
            except Exception:
                store = dist.PrefixStore(f"group/{group_name}", dist.distributed_c10d._get_default_store())
        store = dist.PrefixStore(f"paratrain-shm/{instance}", store)
        n, r = self.size, self.rank
        path = ""
        try:
            if r == 0:
                _sweep_stale(shm_dir)
                token = secrets.token_hex(4)
                tail = f"{token}-{_job_id()}-{_slug(group_name, 16)}"
                self.name = f"{SEGMENT_PREFIX}{self._pid_ns}-{os.getpid()}-{tail}"
                path = os.path.join(shm_dir, self.name)
                self._map(path, create=True)
                nonce = secrets.randbits(62)
                header = (_MAGIC, _VERSION, n, self.capacity_bytes, self.arena_bytes, nonce, self._total, 0)
                self._head[:] = header
                store.set("name", json.dumps({"name": self.name, "nonce": nonce}))
            store.set(f"host/{r}", json.dumps(_host_info()))
            hosts = self._gather(store, "host", "the host check")
            self._same_pidns = all(h["pidns"] == hosts[0]["pidns"] != 0 for h in hosts)
            if any((h["host"], h["boot"]) != (hosts[0]["host"], hosts[0]["boot"]) for h in hosts):
                listing = "; ".join(
                    f"rank {self.peers.global_rank(j)}: {h['host']} (boot {h['boot'][:8]})"
                    for j, h in enumerate(hosts)
                )
                raise ValueError(
                    "shm: the ranks of the group are not all on one host, and shared memory only reaches the "
                    f"ranks of one host ({listing}). Use algorithm 'native' or 'ring' across hosts, or "
                    "hierarchical_all_reduce."
                )
            status = "ok"
            if r != 0:
                self._wait_keys(store, ["name"], "the segment name")
                info = json.loads(store.get("name"))
                self.name = info["name"]
                path = os.path.join(shm_dir, self.name)
                try:
                    self._map(path, create=False)
                    expected = [_MAGIC, _VERSION, n, self.capacity_bytes, self.arena_bytes, info["nonce"]]
                    if self._head[:6].tolist() != expected:
                        status = f"header {self._head[:6].tolist()} != expected {expected}"
                except OSError as e:
                    status = (
                        f"cannot map {path}: {e} (do the ranks pass the same capacity_bytes/arena_bytes?)"
                    )
            store.set(f"attached/{r}", status)
            attached = self._gather(store, "attached", "mapping the segment", decode=False)
            _unlink(path)  # every rank has mapped it (or failed): the name is no longer needed
            bad = [f"rank {self.peers.global_rank(j)}: {s}" for j, s in enumerate(attached) if s != "ok"]
            if bad:
                raise RuntimeError("shm: some ranks could not map the segment: " + "; ".join(bad))
        except BaseException:
            if path:
                _unlink(path)
            self._unmap()
            self.closed = True
            raise
        line = self._lines[r]
        line[_PID], line[_START], line[_STATUS] = os.getpid(), _start_time(os.getpid()) or 0, _OK
        self._futex = _FUTEX if self._use_futex else None
        _MAPPED.add(self)
        self._probe_direct(store, direct)

    def _probe_direct(self, store: Any, wanted: bool) -> None:
        """Decide, collectively, whether the direct path (cross-memory attach) is used: every rank must
        want it (``direct=True`` and ``PARATRAIN_SHM_DIRECT`` not ``0``), share the pid namespace, and
        succeed in reading a private probe word of the next rank with ``process_vm_readv`` and in writing
        it back with ``process_vm_writev``."""
        n, r = self.size, self.rank
        ok = wanted and os.environ.get("PARATRAIN_SHM_DIRECT", "1") != "0" and _VM is not None
        ok = ok and self._same_pidns
        probe = np.array([int(self._head[5]) ^ (r + 1)], dtype=np.int64)  # the nonce, per rank
        if ok and _VM is not None:
            _VM.allow_peers()
        store.set(f"direct/{r}", json.dumps({"pid": os.getpid(), "addr": probe.ctypes.data, "ok": ok}))
        info = self._gather(store, "direct", "the direct-path probe")
        status = "off"
        if all(i["ok"] for i in info) and _VM is not None:
            j = (r + 1) % n
            got = np.zeros(1, dtype=np.int64)
            try:
                _VM.read(info[j]["pid"], got.ctypes.data, info[j]["addr"], 8)
                status = "ok" if int(got[0]) == int(self._head[5]) ^ (j + 1) else "wrong probe value"
                if status == "ok":  # the all-reduce also writes into its peers: the same value back
                    _VM.write(info[j]["pid"], got.ctypes.data, info[j]["addr"], 8)
            except OSError as e:
                status = str(e)
        store.set(f"direct-ok/{r}", status)
        self.direct = all(s == "ok" for s in self._gather(store, "direct-ok", "the direct-path probe", False))
        if self.direct:
            self._vm = _VM
            self._pids = [int(i["pid"]) for i in info]
            if self.tune:
                words = self._lines[0, _TUNE : _TUNE + len(TUNED_FUNCTIONS)]
                self._tuner = PathTuner(r, words, self.direct_min_bytes, DIRECT_MIN_BYTES)

    def _map(self, path: str, create: bool) -> None:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self._total)
            elif os.fstat(fd).st_size != self._total:
                raise OSError(f"size {os.fstat(fd).st_size} != expected {self._total}")
            mm = self._mm = mmap.mmap(fd, self._total)
        finally:
            os.close(fd)
        self._u8 = torch.frombuffer(mm, dtype=torch.uint8)
        words = np.frombuffer(mm, dtype=np.int64, count=self._head_bytes // 8)
        self._head = words[:_HEAD_WORDS]
        self._lines = words[_HEAD_WORDS : _HEAD_WORDS + self.size * _LINE_WORDS].reshape(
            self.size, _LINE_WORDS
        )
        self._lines_addr = self._u8.data_ptr() + _HEAD_WORDS * 8

    def _wait_keys(self, store: Any, keys: list[str], what: str) -> None:
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:
            missing = [k for k in keys if not store.check([k])]
            raise TimeoutError(
                f"shm segment creation: waiting for {what}, {', '.join(missing)} did not arrive within "
                f"{self.timeout_s:g} s"
            ) from None

    def _gather(self, store: Any, key: str, what: str, decode: bool = True) -> list[Any]:
        keys = [f"{key}/{j}" for j in range(self.size)]
        try:
            store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
        except Exception:
            late = [self.peers.global_rank(j) for j, k in enumerate(keys) if not store.check([k])]
            raise TimeoutError(
                f"shm segment creation ({what}): rank {', '.join(map(str, late))} did not arrive within "
                f"{self.timeout_s:g} s"
            ) from None
        values = [store.get(k).decode() for k in keys]
        return [json.loads(v) for v in values] if decode else values

    # -- lifetime ------------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap this rank's view (local, not collective). The memory goes when the last rank's mapping
        does; tensors from :meth:`allocate` that are still referenced keep the mapping alive. A collective
        running on another thread is waited for (up to ``timeout_s``) before the view goes."""
        if self.closed:
            return
        self.closed = True
        if not self._lock.acquire(timeout=self.timeout_s):
            return  # still in use on another thread: leave the mapping to garbage collection
        try:
            if self._mm is not None:
                self._lines[self.rank, _STATUS] = _CLOSED
            self._unmap()
        finally:
            self._lock.release()

    def _unmap(self) -> None:
        _MAPPED.discard(self)
        self._typed.clear()
        self._scratch.clear()
        self._u8 = torch.empty(0, dtype=torch.uint8)
        self._lines = np.zeros((self.size, _LINE_WORDS), dtype=np.int64)
        self._head = np.zeros(_HEAD_WORDS, dtype=np.int64)
        if (
            self._tuner is not None
        ):  # its words view the mapping, which cannot close under a view: keep a copy
            self._tuner.words = self._tuner.words.copy()
        mm, self._mm = self._mm, None
        if mm is not None:
            _close_mapping(mm)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ShmCommunicator(rank={self.rank}, size={self.size}, capacity_bytes={self.capacity_bytes}, "
            f"arena_bytes={self.arena_bytes}, name={self.name!r}, closed={self.closed})"
        )

    # -- views ---------------------------------------------------------------------------------------


def transport_storages() -> list[tuple[torch.Tensor, int]]:
    """The memory this process's shared-memory communicators hold, for a step's memory measurement
    (``paratrain.train.memory``): one ``(tensor, bytes that are this rank's tensors)`` pair per storage.
    Each segment is a whole mapping of ``/dev/shm``, every rank's slots and arenas; of it only the arena
    tensors this rank handed out with ``allocate`` (``dp``'s zero-copy gradient buckets) are
    this rank's data. The rest, and the direct path's private scratch rows, are transport buffers made once
    and reused, like the backend's own, so they count 0."""
    out: list[tuple[torch.Tensor, int]] = []
    for seg in list(_MAPPED):
        if seg._mm is not None and seg._u8.numel():
            out.append((seg._u8, seg._arena_used))
        out.extend((t, 0) for t in seg._scratch.values())
    return out


class _Mismatch(Exception):
    """The ranks disagree on a call; every rank raises it at the same step (the group stays usable)."""


def _close_mapping(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except (BufferError, ValueError):
        pass  # tensors from allocate() still reference it: the mapping goes when they do
