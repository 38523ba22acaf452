"""``paratrain doctor`` as a user runs it: ``python -m paratrain.diagnose.doctor`` in a subprocess, with the
self-test's ranks started by the real torch elastic agent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli_env

pytestmark = pytest.mark.e2e


def doctor(
    *args: str, env: dict[str, str] | None = None, timeout: float = 100
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "paratrain.diagnose.doctor", *args],
        env={**cli_env(), **(env or {})},  # OMP_NUM_THREADS=1, no RANK / MASTER_* of the caller
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def report(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.stdout.strip(), proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def by_name(out: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in out["checks"]}


@pytest.mark.timeout(120)
def test_doctor_on_this_machine_is_healthy_and_measures_every_rank() -> None:
    proc = doctor("--json", "--nproc-per-node", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = report(proc)
    assert out["ok"] is True
    assert {c["status"] for c in out["checks"]} <= {"ok", "warning"}
    checks = by_name(out)
    expected = ["versions", "backends", "gpus", "LOCAL_RANK", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                "NCCL_IB_DISABLE", "MASTER_ADDR", "MASTER_PORT", "/dev/shm", "open files", "ptrace_scope", "free port",
                "hostname", "selftest collectives", "selftest busbw"]  # fmt: skip
    assert [c["name"] for c in out["checks"]] == expected
    assert "torch " in checks["versions"]["detail"] and "python " in checks["versions"]["detail"]
    st = out["selftest"]
    assert st["ran"] and st["nproc"] == 2 and not st["killed_at_deadline"] and st["failed"] == []
    assert [r["rank"] for r in st["ranks"]] == [0, 1]
    for r in st["ranks"]:
        assert r["phase"] == "done" and r["error"] is None
        assert r["collectives"]["all_reduce_sum"] == {"ok": True, "detail": ""}
        assert all(c["ok"] for c in r["collectives"].values()), r["collectives"]
        assert len(r["busbw"]) >= 2 and all(row["busbw_GBps"] > 0 for row in r["busbw"])
        # nccl-tests: busbw = algbw * 2(n-1)/n, which is 1 for two ranks
        assert all(row["busbw_GBps"] == pytest.approx(row["algbw_GBps"]) for row in r["busbw"])
    assert "1" in st["ranks"][0]["p2p_s"]  # rank 0 timed its ping-pong with rank 1


@pytest.mark.timeout(90)
def test_missing_gloo_interface_fails_within_60_s_naming_the_variable() -> None:
    start = time.monotonic()
    proc = doctor(env={"GLOO_SOCKET_IFNAME": "nosuchif0"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert elapsed < 60
    fails = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL")]
    line = next(ln for ln in fails if ln.startswith("FAIL    GLOO_SOCKET_IFNAME:"))
    assert "nosuchif0" in line and "lo (127.0.0.1" in line and "fix: set GLOO_SOCKET_IFNAME" in line
    # the self-test fails too: normally with Gloo's own "Unable to find address for: nosuchif0"; on a
    # machine too loaded to start the ranks within its short deadline, naming the ranks that did not report
    assert any(ln.startswith("FAIL    selftest collectives:") for ln in fails), proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bad_master_port_fails_naming_it_and_the_selftest_still_runs() -> None:
    proc = doctor("--json", env={"MASTER_PORT": "notaport"})
    assert proc.returncode == 1
    out = report(proc)
    assert out["ok"] is False
    failing = [c for c in out["checks"] if c["status"] == "fail"]
    assert [c["name"] for c in failing] == ["MASTER_PORT"]
    assert "notaport" in failing[0]["detail"] and failing[0]["fix"]
    assert (
        by_name(out)["selftest collectives"]["status"] == "ok"
    )  # a standalone job: the launcher picks its port


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_hung_job_is_killed_at_the_deadline_and_its_ranks_named() -> None:
    start = time.monotonic()
    # both ranks sleep with their watchdogs off: only the doctor's own deadline can end this job
    proc = doctor("--json", "--timeout", "15", env={"PARATRAIN_DOCTOR_INJECT": "hang:0,hang:1"})
    assert time.monotonic() - start < 45  # 15 s, plus starting Python and killing, on a loaded machine
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = report(proc)
    st = out["selftest"]
    assert st["killed_at_deadline"] and st["not_finished"] == [0, 1]
    line = by_name(out)["selftest collectives"]
    assert line["status"] == "fail"
    # "ranks 0, 1 did not report: stuck in start-up ...", or, if a rank had not even written its first report
    # (a loaded machine), "rank 1 never started; rank 0 did not report ..."
    assert line["detail"].startswith(("ranks 0, 1 did not report", "rank 0 ", "rank 1 ")), line["detail"]
    for pid in (r["pid"] for r in st["ranks"]):
        assert pid and not _alive(pid), f"rank process {pid} outlived the doctor"


def _alive(pid: int) -> bool:
    for _ in range(20):  # a killed orphan is reaped by init a moment later
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_slow_rank_is_named() -> None:
    proc = doctor("--nproc-per-node", "3", env={"PARATRAIN_DOCTOR_INJECT": "slow:2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr  # slow is a warning, not a failure
    line = next(ln for ln in proc.stdout.splitlines() if "selftest busbw" in ln)
    assert line.startswith("warning selftest busbw: rank 2 slow"), line


@pytest.mark.timeout(120)
def test_the_timeout_counts_from_the_start_of_the_command() -> None:
    """``--timeout`` bounds the whole command: time spent before the checks (the interpreter, imports; here a
    3 s sleep standing in for a slow start) is taken off the self-test's share."""
    code = (
        "import sys, time\n"
        "time.sleep(3)\n"
        "from paratrain.diagnose.doctor import main\n"
        "sys.exit(main(['--json', '--timeout', '30']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    st = report(proc)["selftest"]
    # the self-test gets what is left of 30 s after >= 3 s of start-up and the static checks, minus 1 s
    assert 15 < st["timeout_s"] <= 30 - 3 - 1, st
