"""paratrain doctor's checks without starting any process: the NCCL/Gloo interface syntax against made-up
hosts, the rendezvous variables, the host limits, the slow-rank rule, and how a self-test result becomes
lines."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from paratrain.diagnose import doctor, doctor_net, doctor_selftest
from paratrain.diagnose.doctor_net import Check, IfnameSpec, parse_nccl_ifname, parse_port
from paratrain.diagnose.doctor_selftest import find_slow_ranks, selftest_checks

pytestmark = pytest.mark.timeout(30)

HOST = {
    "lo": ["127.0.0.1", "::1"],
    "eth0": ["10.0.0.5"],
    "eth1": ["10.1.0.5"],
    "docker0": ["172.17.0.1"],
    "ib0": [],  # an interface without an address
}


# ---- NCCL_SOCKET_IFNAME syntax -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "spec"),
    [
        ("eth0", IfnameSpec(("eth0",))),
        ("^lo", IfnameSpec(("lo",), exclude=True)),
        ("^docker,lo", IfnameSpec(("docker", "lo"), exclude=True)),
        ("=eth0", IfnameSpec(("eth0",), exact=True)),
        ("^=docker0,lo", IfnameSpec(("docker0", "lo"), exclude=True, exact=True)),
        ("eth0:1, ib ,", IfnameSpec(("eth0", "ib"))),  # :PORT dropped, blanks and empty items skipped
        ("^", IfnameSpec((), exclude=True)),
    ],
)
def test_parse_nccl_ifname(value: str, spec: IfnameSpec) -> None:
    assert parse_nccl_ifname(value) == spec


@pytest.mark.parametrize(
    ("value", "selected"),
    [
        ("eth", ["eth0", "eth1"]),  # prefixes
        ("=eth", []),  # exact: no interface is called "eth"
        ("=eth1", ["eth1"]),
        ("^lo", ["eth0", "eth1", "docker0", "ib0"]),
        ("^docker,lo", ["eth0", "eth1", "ib0"]),  # the ^ applies to the whole list, as NCCL reads it
        ("^=eth0", ["lo", "eth1", "docker0", "ib0"]),
    ],
)
def test_nccl_selection_on_a_host(value: str, selected: list[str]) -> None:
    assert parse_nccl_ifname(value).select(list(HOST)) == selected


def test_nccl_ifname_check_statuses() -> None:
    ok = doctor_net.check_nccl_ifname({"NCCL_SOCKET_IFNAME": "^lo"}, HOST)
    assert ok.status == "ok" and "eth0, eth1, docker0" in ok.detail and "ib0" not in ok.detail.split("->")[1]
    missing = doctor_net.check_nccl_ifname({"NCCL_SOCKET_IFNAME": "nosuch"}, HOST)
    assert (
        missing.status == "fail"
        and "eth0 (10.0.0.5)" in missing.detail
        and "NCCL_SOCKET_IFNAME" in missing.fix
    )
    no_address = doctor_net.check_nccl_ifname({"NCCL_SOCKET_IFNAME": "ib"}, HOST)
    assert no_address.status == "fail" and "without an address" in no_address.detail
    partly = doctor_net.check_nccl_ifname({"NCCL_SOCKET_IFNAME": "eth0,bond"}, HOST)
    assert partly.status == "warning" and "bond matches no interface" in partly.detail
    assert doctor_net.check_nccl_ifname({}, HOST).status == "ok"


# ---- GLOO_SOCKET_IFNAME ------------------------------------------------------------------------------------


def test_gloo_ifname_missing_interface_fails_naming_the_variable_and_the_host() -> None:
    c = doctor_net.check_gloo_ifname({"GLOO_SOCKET_IFNAME": "nosuchif0"}, HOST)
    assert c.status == "fail" and c.name == "GLOO_SOCKET_IFNAME"
    assert "nosuchif0" in c.detail and "lo (127.0.0.1, ::1)" in c.detail and "eth0 (10.0.0.5)" in c.detail
    assert "GLOO_SOCKET_IFNAME=eth0" in c.fix  # a non-loopback interface with an address is suggested


@pytest.mark.parametrize(
    ("value", "status", "words"),
    [
        ("lo", "ok", "Gloo uses lo"),
        ("eth0,eth1", "ok", "eth1 (10.1.0.5)"),
        ("eth0,nosuch", "fail", "no interface named nosuch"),
        ("ib0", "fail", "ib0 has no address"),
        ("^lo", "fail", "no NCCL-style ^ or = prefix"),  # Gloo has no prefix syntax
        ("eth0,,eth1", "fail", "no empty items"),
    ],
)
def test_gloo_ifname(value: str, status: str, words: str) -> None:
    c = doctor_net.check_gloo_ifname({"GLOO_SOCKET_IFNAME": value}, HOST)
    assert c.status == status and words in c.detail


# ---- NCCL_IB_DISABLE, MASTER_ADDR, MASTER_PORT -------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "status"), [("0", "ok"), ("1", "ok"), (" 1 ", "ok"), ("yes", "fail"), ("", "fail")]
)
def test_ib_disable(value: str, status: str) -> None:
    assert doctor_net.check_ib_disable({"NCCL_IB_DISABLE": value}).status == status


@pytest.mark.parametrize(
    ("value", "result"),
    [("29500", 29500), ("1", 1), ("65535", 65535), ("notaport", "'notaport' is not a port number"),
     ("0", "0 is outside 1..65535"), ("70000", "70000 is outside 1..65535"),
     ("-5", "'-5' is not a port number")],
)  # fmt: skip
def test_parse_port(value: str, result: int | str) -> None:
    assert parse_port(value) == result


def test_master_port_not_a_port_fails_naming_it() -> None:
    c = doctor_net.check_master_port({"MASTER_PORT": "notaport"}, HOST)
    assert c.status == "fail" and c.name == "MASTER_PORT" and "notaport" in c.detail and "29500" in c.fix


def test_master_port_in_use_on_this_host_fails_unless_inside_a_job() -> None:
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        busy = doctor_net.check_master_port(env, HOST)
        assert busy.status == "fail" and "already in use" in busy.detail and f":{port}" in busy.fix
        inside = doctor_net.check_master_port({**env, "RANK": "0"}, HOST)  # the job's own store holds it
        assert inside.status == "ok"
    with socket.socket() as s:
        s.bind(("", 0))
        free = s.getsockname()[1]
    assert doctor_net.check_master_port({"MASTER_PORT": str(free)}, HOST).status == "ok"


def test_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    assert doctor_net.check_master_addr({}, HOST).status == "ok"
    here = doctor_net.check_master_addr({"MASTER_ADDR": "127.0.0.1"}, HOST)
    assert here.status == "ok" and "this host (lo)" in here.detail
    mine = doctor_net.check_master_addr({"MASTER_ADDR": "10.0.0.5"}, HOST)
    assert mine.status == "ok" and "this host (eth0)" in mine.detail
    bad = doctor_net.check_master_addr({"MASTER_ADDR": "no-such-host.invalid"}, HOST)
    assert bad.status == "fail" and "does not resolve" in bad.detail
    # another host, while Gloo is pinned to loopback: the other nodes could never reach this one
    monkeypatch.setattr(doctor_net, "_route_interface", lambda addr, ifaces: "eth0")
    remote = doctor_net.check_master_addr({"MASTER_ADDR": "203.0.113.7", "GLOO_SOCKET_IFNAME": "lo"}, HOST)
    assert remote.status == "warning" and "GLOO_SOCKET_IFNAME selects only loopback" in remote.detail
    assert "GLOO_SOCKET_IFNAME=eth0" in remote.fix
    fine = doctor_net.check_master_addr({"MASTER_ADDR": "203.0.113.7", "NCCL_SOCKET_IFNAME": "^lo"}, HOST)
    assert fine.status == "ok" and "another host, reached through eth0" in fine.detail


# ---- devices and host limits -------------------------------------------------------------------------------


def test_local_rank_mapping() -> None:
    assert doctor._check_local_rank({}, 2, None).status == "ok"
    assert doctor._check_local_rank({"LOCAL_RANK": "x"}, 2, None).status == "fail"
    assert doctor._check_local_rank({"LOCAL_RANK": "3"}, 0, None).status == "ok"  # CPU: nothing to map
    over = doctor._check_local_rank({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4"}, 2, None)
    assert over.status == "fail" and "only 2 GPU(s)" in over.detail and "--nproc-per-node 2" in over.fix
    crowded = doctor._check_local_rank({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}, 2, None)
    assert crowded.status == "fail"


@pytest.mark.parametrize(
    ("value", "count", "status"),
    [("0,1", 2, "ok"), ("GPU-abc,1", 2, "ok"), ("0,0", 1, "fail"), ("0,x", 1, "fail"), ("", 0, "warning"),
     ("-1", 0, "warning"), ("0,1,2,3", 2, "warning")],
)  # fmt: skip
def test_cuda_visible_devices(value: str, count: int, status: str) -> None:
    assert doctor._check_visible(value, count, cuda_build=True).status == status


def test_shm_and_open_files(monkeypatch: pytest.MonkeyPatch) -> None:
    assert doctor.check_shm("/no/such/dir").status == "warning"

    class Small:
        f_blocks, f_bavail, f_frsize = 64 * 256, 64 * 256, 4096  # 64 MiB: docker's default

    monkeypatch.setattr(os, "statvfs", lambda path: Small())
    small = doctor.check_shm()
    assert small.status == "warning" and "0.1 GiB" in small.detail and "--shm-size" in small.fix
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda which: (1024, 8192))
    low = doctor.check_open_files()
    assert low.status == "warning" and "ulimit -n 8192" in low.fix
    monkeypatch.setattr(doctor.resource, "getrlimit", lambda which: (65536, 65536))
    assert doctor.check_open_files().status == "ok"


def test_check_line_format() -> None:
    assert Check("versions", "ok", "python 3.11.7", "never shown").line() == "ok      versions: python 3.11.7"
    assert Check("X", "warning", "d", "f").line() == "warning X: d fix: f"
    assert Check("GLOO_SOCKET_IFNAME", "fail", "d.", "f.").line() == "FAIL    GLOO_SOCKET_IFNAME: d. fix: f."


# ---- the self-test's judgement -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("times", "slow"),
    [
        ({0: 1.0, 1: 1.1, 2: 5.0, 3: 0.9}, [2]),
        ({0: 1.0, 1: 3.0}, [1]),  # two ranks: each is compared with the other
        ({0: 1.0, 1: 1.9}, []),
        ({0: 4.0, 1: 1.0, 2: 1.2}, [0]),
        ({0: 1.0, 1: 5.0, 2: 5.0}, []),  # half the ranks slow: no majority to compare with
        ({0: 1.0}, []),
        ({}, []),
    ],
)
def test_find_slow_ranks(times: dict[int, float], slow: list[int]) -> None:
    assert find_slow_ranks(times) == slow


def _rank(rank: int, phase: str = "done", error: str | None = None, **kw: Any) -> dict[str, Any]:
    ok = {name: {"ok": True, "detail": ""} for name in doctor_selftest.COLLECTIVES}
    report = {"rank": rank, "pid": 100 + rank, "phase": phase, "error": error}
    if phase == "done":
        report |= {"backend": "gloo", "device": "cpu", "collectives": ok, "p2p": {}}
        report["busbw"] = [{"bytes": 8 << 20, "time_s": 0.01, "algbw_GBps": 0.8, "busbw_GBps": 0.8}]
    return report | kw


def _judge(
    reports: dict[int, dict[str, Any]], nproc: int = 2, killed: bool = False, error: str | None = None
) -> list[Check]:
    agent: dict[str, Any] = {"ok": error is None, "error": error, "failures": []}
    return selftest_checks(doctor_selftest._summarize(nproc, 10.0, 10.0, killed, reports, agent, []))


def test_selftest_all_good() -> None:
    lines = _judge({0: _rank(0), 1: _rank(1)})
    assert [c.status for c in lines] == ["ok", "ok"]
    assert "send_recv_ring" in lines[0].detail and "rank 1 0.80" in lines[1].detail


def test_selftest_names_the_rank_that_never_reported_first() -> None:
    reports = {0: _rank(0, "init", "timed out in phase 'init': ..."), 1: _rank(1, "start")}
    c = _judge(reports)[0]
    assert c.status == "fail"
    assert c.detail.startswith("rank 1 did not report: stuck in start-up")
    assert "rank 0 waited in init_process_group until the deadline" in c.detail
    assert "NCCL_DEBUG=INFO" in c.fix
    killed = _judge({0: _rank(0, "collectives"), 1: _rank(1, "collectives")}, killed=True)[0]
    assert "ranks 0, 1 did not report: stuck in the collectives, killed at the deadline" in killed.detail
    never = _judge({0: _rank(0, "init", "timed out ...")}, killed=True)[0]
    assert never.detail.startswith("rank 1 never started")


def test_selftest_error_first_then_the_ranks_the_launcher_stopped() -> None:
    err = "RuntimeError: Unable to find address for: nosuchif0"
    c = _judge({0: _rank(0, "init", err), 1: _rank(1, "start")}, error="rank 0 failed")[0]
    assert c.detail.startswith(f"rank 0 failed in init_process_group: {err}")
    assert "rank 1 was stopped in start-up" in c.detail and "SOCKET_IFNAME" in c.fix


def test_selftest_wrong_result_and_slow_rank() -> None:
    wrong = _rank(1)
    wrong["collectives"] = dict(
        wrong["collectives"], all_gather={"ok": False, "detail": "got [[0, 0]], expected [[0, 1]]"}
    )
    assert "rank 1 all_gather got [[0, 0]], expected [[0, 1]]" in _judge({0: _rank(0), 1: wrong})[0].detail
    reports = {q: _rank(q) for q in range(3)}
    reports[0]["p2p"] = {"1": 0.001, "2": 0.030}
    lines = _judge(reports, nproc=3)
    assert lines[0].status == "ok"
    assert lines[1].status == "warning" and lines[1].detail.startswith("rank 2 slow")


def test_selftest_launcher_refusal_is_reported_as_is() -> None:
    err = "--nproc-per-node 4 but this machine has 1 GPU(s): start at most one process per GPU"
    c = _judge({}, nproc=4, error=err)[0]
    assert c.status == "fail" and c.detail == f"the launcher failed: {err}"
    assert "--nproc-per-node at most the GPU count" in c.fix


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["doctor", "--timeout", "inf"], "--timeout must be a positive number"),
        (["doctor", "--timeout", "nan"], "--timeout must be a positive number"),
        (["launch", "--guard", "--hang-timeout", "nan", __file__], "--hang-timeout must be a finite number"),
    ],
)
def test_non_finite_timeouts_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from paratrain.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_ptrace_scope_is_reported(tmp_path: Path) -> None:
    for value, words in (("1", "every process of the same user"), ("2", "refused"), ("0", "classic")):
        (tmp_path / "scope").write_text(value + "\n")
        check = doctor.check_ptrace_scope(str(tmp_path / "scope"))
        assert (
            check.status == "ok"
            and f"kernel.yama.ptrace_scope={value}" in check.detail
            and words in check.detail
        )
    assert "no Yama" in doctor.check_ptrace_scope(str(tmp_path / "absent")).detail
    names = [c.name for c in doctor.collect(selftest=False)[0]]
    assert "ptrace_scope" in names
