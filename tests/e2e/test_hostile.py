"""paratrain used as a hostile user and a hostile environment would use it (issue: nothing silently wrong).

Each test fails on the behaviour it guards against: non-finite training that exits 0, tracebacks instead of
one message, workers that outlive a SIGKILLed launcher, a loopback job listening on every interface, a
resume that silently trains nothing, a dead-peer report that names the survivor.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.testing import free_port
from tests.conftest import cli_env, last_json, run_cli

pytestmark = pytest.mark.e2e

MLP = ["--model", "mlp", "--set", "model.hidden=16", "--batch-size", "16", "--optimizer", "sgd"]


def _no_traceback(text: str) -> None:
    assert "Traceback" not in text, text


@pytest.mark.timeout(120)
def test_diverging_lr_stops_with_nonzero_exit_naming_step_and_parameter(tmp_path: Path) -> None:
    # with restarts left: a restart would resume from the same checkpoint and diverge the same way, so the
    # job ends at the first failure (this run is also tests/e2e/test_fail_fast.py's non-finite case)
    proc = run_cli("train", *MLP, "--lr", "1e30", "--steps", "20", "--nproc-per-node", "2", "--max-restarts", "3",
                   "--run-dir", str(tmp_path / "r"), cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    err = proc.stderr
    assert "non-finite loss or gradient at step" in err, err
    assert "first non-finite parameter gradient: blocks." in err, err  # named without DDP's "module."
    assert not (tmp_path / "r" / "summary.json").exists()
    assert "not restarted (--max-restarts 3 left unused): non-finite values" in err, err
    assert "NonFiniteError: non-finite loss or gradient at step" in err, err
    assert "restart(s) by the elastic agent" not in err, err
    _no_traceback(err)


@pytest.mark.timeout(120)
def test_nonfinite_stops_every_rank_of_zero_copy_dp(tmp_path: Path) -> None:
    # each rank checks half of the (replicated) gradients; the verdict must still stop both ranks at once
    proc = run_cli("train", *MLP, "--lr", "1e30", "--steps", "20", "--strategy", "dp", "--comm-algorithm", "shm",
                   "--nproc-per-node", "2", "--run-dir", str(tmp_path / "r"), cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert "non-finite loss or gradient at step" in proc.stderr, proc.stderr
    assert "first non-finite parameter gradient: blocks." in proc.stderr, proc.stderr
    _no_traceback(proc.stderr)
    assert not (tmp_path / "r" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_skip_mode_skips_then_stops_at_the_limit(tmp_path: Path) -> None:
    proc = run_cli("train", *MLP, "--lr", "1e30", "--steps", "30", "--set", "train.on_nonfinite=skip",
                   "--set", "train.max_nonfinite_skips=2", "--nproc-per-node", "1", "--strategy", "single",
                   "--run-dir", str(tmp_path / "r"), cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.count("skipping step") == 2, proc.stderr
    assert "non-finite loss or gradient" in proc.stderr


BAD_VALUES = [
    (["train", "--timeout", "inf"], "must be a finite number"),
    (["train", "--lr", "nan"], "must be a finite number"),
    (["train", "--set", "optimizer.betas=0.9,1.5"], "optimizer.betas[1] must be in [0.0, 1.0)"),
    (["train", "--set", "optimizer.momentum=-1"], "optimizer.momentum must be >= 0"),
    (["train", "--seed", str(2**70)], "train.seed must be in [0, 2**63)"),
    (["train", "--set", "optimizer.grad_clip=nan"], "must be a finite number"),
    (["train", "--rdzv-endpoint", "not_a_host_port"], "write HOST:PORT"),
    (["launch", "--rdzv-backend", "bogus", "x.py"], "invalid choice: 'bogus'"),
    (["train", "--nproc-per-node", "1000"], "more likely, fewer processes"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("argv", "needle"), BAD_VALUES)
def test_bad_values_get_one_message_and_no_traceback(
    tmp_path: Path,
    argv: list[str],
    needle: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CLI's own entry point, in this process (the same code a user's shell runs, without the cost of
    a new interpreter per case); one case also goes through a real subprocess below."""
    from paratrain.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = int(e.code or 0)
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err, err
    _no_traceback(err)
    assert not (tmp_path / "runs").exists()  # refused before anything started


@pytest.mark.timeout(60)
def test_bad_value_from_a_shell_is_one_message(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = run_cli("train", "--timeout", "inf", cwd=tmp_path, check=False, timeout=50)
    assert proc.returncode == 2 and "must be a finite number" in proc.stderr, proc.stderr
    _no_traceback(proc.stderr)
    assert time.monotonic() - t0 < 40


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_resume_past_the_requested_steps_says_nothing_to_train(tmp_path: Path) -> None:
    run = ["train", *MLP, "--nproc-per-node", "1", "--strategy", "single", "--run-dir", str(tmp_path / "r")]
    run_cli(*run, "--steps", "6", cwd=tmp_path)
    proc = run_cli(*run, "--steps", "4", "--json", cwd=tmp_path)
    assert "already at step 6" in proc.stderr and "nothing to train" in proc.stderr, proc.stderr
    assert last_json(proc.stdout)["steps"] == 6


@pytest.mark.timeout(60)
def test_oversubscribed_cores_warn_once(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("import os\n")
    n = (os.cpu_count() or 1) + 1
    proc = run_cli("launch", "--nproc-per-node", str(n), str(script), cwd=tmp_path)
    assert proc.stderr.count("oversubscribed") == 1, proc.stderr


def _listening_sockets(pids: set[int]) -> list[str]:
    """Local addresses of the LISTEN sockets owned by ``pids`` (IPv4 and IPv6), from /proc."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # 0A = LISTEN
                    out.append(cols[1])
    return out


def _is_loopback(hex_addr: str) -> bool:
    addr = hex_addr.split(":")[0]
    if len(addr) == 8:  # IPv4, little-endian: 127.x.x.x ends with 7F
        return addr.endswith("7F")
    return addr in ("00000000000000000000000001000000",)  # ::1 in /proc's byte order


def _tree(pid: int) -> set[int]:
    seen, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("endpoint", ["127.0.0.1", pytest.param("localhost", marks=pytest.mark.slow)])
def test_loopback_endpoint_listens_on_loopback_only(tmp_path: Path, endpoint: str) -> None:
    script = tmp_path / "hold.py"
    script.write_text(
        "import os, time, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "dist.barrier()\n"
        "open(os.environ['READY'] + str(dist.get_rank()), 'w').close()\n"
        "time.sleep(6)\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    env = cli_env() | {"READY": str(tmp_path / "ready")}
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "paratrain", "launch", "--nproc-per-node", "2", "--rdzv-endpoint",
         f"{endpoint}:{port}", str(script)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "workers never got ready"
            time.sleep(0.2)
        sockets = _listening_sockets(_tree(proc.pid))
        assert sockets, "found no listening socket of the job (the check would be vacuous)"
        exposed = [s for s in sockets if not _is_loopback(s)]
        assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"
    finally:
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "no authentication" not in err  # the warning is for non-loopback endpoints only


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigkill_of_the_launcher_group_leaves_no_worker_and_rerun_resumes_exactly(tmp_path: Path) -> None:
    common = [*MLP, "--steps", "400", "--ckpt-every", "20", "--run-dir", str(tmp_path / "r")]
    ref = last_json(run_cli("train", *MLP, "--steps", "400", "--run-dir", str(tmp_path / "ref"), "--json",
                            cwd=tmp_path, timeout=200).stdout)  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "paratrain", "train", *common], cwd=tmp_path, env=cli_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    ckpts = tmp_path / "r" / "checkpoints"
    deadline = time.monotonic() + 120
    while not (ckpts / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the kill"
        time.sleep(0.2)
    workers = _tree(proc.pid) - {proc.pid}
    assert workers, "no worker processes found"
    os.killpg(
        proc.pid, signal.SIGKILL
    )  # the launcher's whole process group, as an OOM killer or a shell would
    proc.wait()
    time.sleep(5)
    alive = [p for p in workers if Path(f"/proc/{p}").exists() and "zombie" not in _state(p)]
    assert not alive, f"workers {alive} outlived their launcher by 5 s"
    again = last_json(run_cli("train", *common, "--json", cwd=tmp_path, timeout=200).stdout)
    assert again["resumed_from_step"] and again["resumed_from_step"] % 20 == 0
    assert again["param_sha256"] == ref["param_sha256"]


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((ln for ln in f if ln.startswith("State:")), "").lower()
    except OSError:
        return "zombie"


@pytest.mark.slow
def test_json_of_failure_is_not_printed_on_failure(tmp_path: Path) -> None:
    """A failed run prints no summary object: a script reading the last line as JSON must not see success."""
    proc = run_cli("train", *MLP, "--lr", "1e30", "--steps", "5", "--json", "--run-dir", str(tmp_path / "r"),
                   cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    for ln in lines:
        with pytest.raises(json.JSONDecodeError):
            json.loads(ln)


@pytest.mark.timeout(240)
@pytest.mark.slow
@pytest.mark.parametrize("target", ["distcp", "train_state"])
def test_same_size_damage_to_the_newest_checkpoint_falls_back_and_ends_identical(
    tmp_path: Path, target: str
) -> None:
    """A 4-byte flip inside a tensor file, or a same-size edit of train_state.json, of the newest checkpoint:
    ``--resume auto`` skips it (naming the file), resumes from the previous one, and ends bit-identical to an
    uninterrupted run."""
    steps = ["--steps", "30"]
    ref = last_json(run_cli("train", *MLP, *steps, "--run-dir", str(tmp_path / "ref"), "--json",
                            cwd=tmp_path, timeout=200).stdout)  # fmt: skip
    run = ["train", *MLP, "--ckpt-every", "10", "--run-dir", str(tmp_path / "r")]
    run_cli(*run, "--steps", "20", cwd=tmp_path, timeout=200)
    newest = tmp_path / "r" / "checkpoints" / "step_00000020"
    if target == "distcp":
        f = sorted(newest.glob("*.distcp"))[0]
        data = bytearray(f.read_bytes())
        mid = len(data) // 2
        data[mid : mid + 4] = bytes(b ^ 0xFF for b in data[mid : mid + 4])
        f.write_bytes(bytes(data))
    else:
        f = newest / "train_state.json"
        text = f.read_text()
        assert '"step": 20' in text
        f.write_text(text.replace('"step": 20', '"step": 90'))  # same size, wrong content
    proc = run_cli(*run, *steps, "--json", cwd=tmp_path, timeout=200)
    got = last_json(proc.stdout)
    assert f.name in proc.stderr and "skipping checkpoint" in proc.stderr, proc.stderr
    assert got["resumed_from_step"] == 10
    assert got["param_sha256"] == ref["param_sha256"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_second_job_on_the_same_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    common = [*MLP, "--steps", "100000", "--run-dir", str(tmp_path / "r")]
    first = subprocess.Popen([sys.executable, "-m", "paratrain", "train", *common], cwd=tmp_path, env=cli_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        lock = tmp_path / "r" / "checkpoints" / ".lock"
        deadline = time.monotonic() + 90
        while not (lock.exists() and lock.stat().st_size > 0):
            assert first.poll() is None and time.monotonic() < deadline, "the first job never took the lock"
            time.sleep(0.2)
        second = run_cli("train", *common, cwd=tmp_path, check=False, timeout=60)
        assert second.returncode == 2, second.stderr
        assert "is in use by job" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr
        _no_traceback(second.stderr)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
