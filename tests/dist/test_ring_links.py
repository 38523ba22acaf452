"""The ring's own TCP links (``paratrain.comm._tcp``): used where they should be, the same results as the ring
over c10d's point-to-point bit for bit, turned off by ``PARATRAIN_RING_LINKS=c10d`` on any rank, and a
dead or hung neighbour named in the error well before anything else would notice.

Every ring call in ``test_comm.py`` also goes over the links (they are the default on one host), against
torch.distributed's own collectives, for every dtype, op and odd shape.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratrain.comm import _tcp, ring
from paratrain.comm._common import chunk_bounds, peers
from paratrain.testing import call_until_the_last_rank_dies, run_distributed, run_processes


def _links_of(group: Any = None) -> _tcp.RingLinks | None:
    pg = group if group is not None else dist.group.WORLD
    entry = _tcp._CACHE.get(id(pg))
    assert entry is not None and entry.pg is pg and entry.decided, (
        "no links decision was cached for the group"
    )
    return entry.links


def links_against_c10d() -> dict[str, Any]:
    """Random floats (so the order of the additions shows), many pieces per chunk, every ring function."""
    rank, n = dist.get_rank(), dist.get_world_size()
    p = peers("test", None)
    mismatches: list[str] = []
    for numel in (0, 1, n - 1, 1000, 4099):
        for op in ("sum", "mean", "max", "prod"):
            for dtype in (torch.float32, torch.float64, torch.bfloat16):
                g = torch.Generator().manual_seed(1000 * rank + numel)
                x = (torch.rand(numel, generator=g) + 0.5).to(dtype)
                for rs, ag in ((True, True), (True, False), (False, True)):
                    bounds = chunk_bounds(numel, n)
                    a, b = x.clone(), x.clone()
                    # 64-byte pieces: a chunk of 1000 floats is 16 pieces, so every step pipelines
                    ring.ring(a, bounds, op, p, rs, ag, piece_bytes=64, links=True)
                    ring.ring(b, bounds, op, p, rs, ag, piece_bytes=64, links=False)
                    if not torch.equal(a, b):
                        mismatches.append(f"{numel} {op} {dtype} rs={rs} ag={ag}")
    # a group of its own (ranks 0 and the last) gets links of its own
    sub = dist.new_group([0, n - 1])
    y = torch.full((10,), float(rank + 1))
    if rank in (0, n - 1):
        ring.all_reduce(y, "sum", peers("test", sub))
    links = _links_of()
    return {
        "mismatches": mismatches,
        "world_links": links is not None and not links.closed,
        "left_right": (links.left, links.right) if links is not None else None,
        "sub_links": rank not in (0, n - 1) or _links_of(sub) is not None,
        "sub_result": y.tolist(),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 5])
def test_links_are_used_and_give_the_c10d_rings_bits(world: int) -> None:
    outs = run_distributed(links_against_c10d, world, timeout_s=200)
    for r, o in enumerate(outs):
        assert o["mismatches"] == [], (r, o["mismatches"][:5])
        assert o["world_links"]
        assert o["left_right"] == ((r - 1) % world, (r + 1) % world)
        assert o["sub_links"]
        if r in (0, world - 1):
            assert o["sub_result"] == [float(1 + world)] * 10
        else:
            assert o["sub_result"] == [float(r + 1)] * 10


def links_off(off_ranks: list[int]) -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    if rank in off_ranks:
        os.environ[_tcp.ENV] = "c10d"
    x = torch.arange(100, dtype=torch.float32) * (rank + 1)
    ring.all_reduce(x, "sum", peers("test", None))
    expected = torch.arange(100, dtype=torch.float32) * (n * (n + 1) // 2)
    return {"equal": torch.equal(x, expected), "links": _links_of() is not None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("off_ranks", [[0, 1, 2], [1]], ids=["every-rank", "one-rank"])
def test_env_c10d_turns_the_links_off_for_the_whole_group(off_ranks: list[int]) -> None:
    for o in run_distributed(links_off, 3, args=(off_ranks,), timeout_s=100):
        assert o == {"equal": True, "links": False}


def test_decide_names_why_a_group_cannot_have_links() -> None:
    here = {"mode": "auto", "host": "a", "boot": "1", "port": 5, "error": ""}
    assert _tcp.decide([here, dict(here)]) is None
    assert "not all on one host" in str(_tcp.decide([here, {**here, "host": "b"}]))
    assert "not all on one host" in str(_tcp.decide([here, {**here, "boot": "2"}]))
    assert "rank(s) [1]" in str(_tcp.decide([here, {**here, "mode": "c10d"}]))
    assert "group rank 0: cannot listen" in str(_tcp.decide([{**here, "error": "cannot listen"}, here]))


def test_a_bad_env_value_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_tcp.ENV, "nccl")
    with pytest.raises(ValueError, match="PARATRAIN_RING_LINKS='nccl': expected 'auto'"):
        _tcp._mode()


# -- failures: a hung rank, a killed rank ------------------------------------------------------------


def hung_rank() -> dict[str, Any]:
    rank = dist.get_rank()
    p = peers("test", None)
    x = torch.ones(1000)
    ring.all_reduce(x, "sum", p)  # the links exist (the set-up used the group's own timeout)
    links = _links_of()
    assert links is not None
    links.timeout_s = 2.0  # what a group created with a 2 s timeout would have
    out: dict[str, Any] = {}
    if rank == 1:
        time.sleep(4.0)
    start = time.monotonic()
    try:
        ring.all_reduce(x, "sum", p)
        out["error"] = "no error"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["elapsed"] = time.monotonic() - start
    try:
        ring.all_reduce(x, "sum", p)
        out["again"] = "no error"
    except Exception as e:
        out["again"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(90)
def test_a_hung_neighbour_is_named_after_the_timeout() -> None:
    r0, _ = run_distributed(hung_rank, 2, timeout_s=60)
    assert r0["error"].startswith("TimeoutError: ring all_reduce: rank 1 sent nothing for 2 s"), r0["error"]
    assert 1.9 < r0["elapsed"] < 5.0
    assert "rank 1 sent nothing" in r0["again"]  # the links stay failed, with the same reason


def _kill_worker(rank: int, world: int, init_file: str, outdir: str, fork_child: bool = False) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    p = peers("test", None)
    x = torch.ones(1 << 18)  # 1 MiB: a call is several pieces per step
    for _ in range(3):
        ring.all_reduce(x, "sum", p)
    report: dict[str, Any] = {"links": _links_of() is not None}
    if fork_child and rank == world - 1:
        # a forked child (as a DataLoader worker would be) that outlives the rank: it must not hold the
        # rank's sockets open, or the neighbours would wait for the timeout instead of failing at once
        if os.fork() == 0:
            time.sleep(20)
            os._exit(0)
    call_until_the_last_rank_dies(lambda: ring.all_reduce(x, "sum", p), rank, world, report, outdir)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fork_child", [False, True], ids=["alone", "with-a-forked-child"])
def test_a_killed_neighbour_fails_the_ring_at_once_naming_it(tmp_path: Path, fork_child: bool) -> None:
    world = 3
    args = (str(tmp_path / "rdzv"), str(tmp_path), fork_child)
    codes = run_processes(_kill_worker, world, args=args, timeout_s=60)
    assert codes[-1] == -signal.SIGKILL
    reports = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(world)]
    assert all(r["links"] for r in reports)
    # rank 0 receives from rank 2 (its left): the kernel closed rank 2's sockets, so rank 0 sees it at once
    assert "rank 2 closed its link" in reports[0]["error"], reports[0]
    # rank 1 sends to rank 2 and receives from rank 0: whichever fails first is named
    assert "rank 2 closed its link" in reports[1]["error"] or "rank 0 closed its link" in reports[1]["error"]
    for r in reports[:-1]:
        assert "exited or was killed" in r["error"], r
        assert r["elapsed"] < 10.0, r  # the group's timeout is 60 s: nothing waited for it


def _listening_ports() -> set[int]:
    """The TCP ports this process listens on (its sockets' inodes matched in /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                ports.add(int(cols[1].split(":")[1], 16))
    return ports


def intruders_then_fallback_log() -> dict[str, Any]:
    """A local process connects first to rank 0's listening port (a burst of connections speaking garbage,
    started the moment the port opens); then a group whose rank 1 asked for c10d."""
    import logging

    rank, n = dist.get_rank(), dist.get_world_size()
    before = _listening_ports()
    connected = []

    def intrude() -> None:
        deadline = time.monotonic() + 30
        while not (new := _listening_ports() - before) and time.monotonic() < deadline:
            time.sleep(0.001)
        for port in new:
            for _ in range(3):  # the port's backlog holds a few; the handshake accepts them first
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                        s.sendall(b"\0" * _tcp._HELLO.size)
                        connected.append(time.monotonic())
                except OSError:
                    return

    t = threading.Thread(target=intrude, daemon=True)
    if rank == 0:
        t.start()
    if rank == 1:
        time.sleep(2)  # rank 0 waits for this rank's offer with its own port open: its intruders get in first
    x = torch.full((1000,), float(rank + 1))
    ring.all_reduce(x, "sum", peers("test", None))
    if rank == 0:
        t.join(timeout=30)
    links = _links_of()
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("paratrain.comm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    if rank == 1:
        os.environ[_tcp.ENV] = "c10d"
    sub = dist.new_group(list(range(n)))
    y = torch.ones(10)
    ring.all_reduce(y, "sum", peers("test", sub))
    return {
        "links": links is not None and not links.closed,
        "refused": links.refused if links is not None else None,
        "intruders": len(connected),
        "sum": x[0].item(),
        "sub_links": _links_of(sub) is not None,
        "logs": [r.getMessage() for r in records],
    }


@pytest.mark.timeout(120)
def test_a_local_process_that_connects_first_does_not_switch_the_links_off_and_a_fallback_is_logged() -> None:
    outs = run_distributed(intruders_then_fallback_log, 2, timeout_s=100)
    assert outs[0]["intruders"] >= 1 and outs[0]["refused"] >= 1  # they were there first, and refused
    for r, o in enumerate(outs):
        assert o["links"], f"rank {r}: the links were switched off by the intruders"
        assert o["sum"] == 3.0
        assert not o["sub_links"]
    fallback = [m for m in outs[0]["logs"] if "uses c10d's point-to-point" in m]
    assert len(fallback) == 1 and "PARATRAIN_RING_LINKS=c10d on rank(s) [1]" in fallback[0], outs[0]["logs"]
    assert not [m for m in outs[1]["logs"] if "uses c10d's point-to-point" in m]  # once per group


def signatures_checked_once() -> dict[str, Any]:
    from paratrain import comm
    from paratrain.comm._check import verified_signatures

    rank = dist.get_rank()
    a, b = torch.ones(8), torch.ones(16)
    for _ in range(5):
        comm.all_reduce(a.clone(), algorithm="ring")
        comm.all_reduce(b.clone(), algorithm="ring")
    checked = verified_signatures(dist.group.WORLD)
    # each shape was checked before: the ranks now diverge between the two, and no all-gather runs
    try:
        comm.all_reduce(a.clone() if rank == 0 else b.clone(), algorithm="ring")
        error = None
    except ValueError as e:
        error = str(e)
    return {"checked": checked, "error": error}


@pytest.mark.timeout(120)
def test_each_call_signature_is_checked_once_and_a_divergence_between_known_ones_is_still_caught() -> None:
    outs = run_distributed(signatures_checked_once, 2, timeout_s=100)
    for o in outs:
        assert o["checked"] == 2  # two signatures, ten calls
        assert o["error"] is not None and "disagree on the call" in o["error"], o["error"]
        assert "8 elements" in o["error"] and "16 elements" in o["error"], o["error"]
