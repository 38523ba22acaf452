"""`paratrain train` run exactly as a user runs it, and bad input rejected before any process starts."""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

CONTRACT = {
    "strategy",
    "world_size",
    "num_params",
    "steps",
    "losses",
    "final_loss",
    "eval_accuracy",
    "samples_per_s",
    "param_sha256",
    "param_norm",
    "model_state_bytes_per_rank",
    "restarts",
    "resumed_from_step",
}


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_default_train_reaches_90_percent_on_digits(tmp_path: Path) -> None:
    proc = run_cli("train", "--json", cwd=tmp_path)
    s = last_json(proc.stdout)
    assert set(s) >= CONTRACT, CONTRACT - set(s)
    assert s["strategy"] == "ddp" and s["world_size"] == 2
    assert s["eval_accuracy"] >= 0.9
    assert len(s["losses"]) == s["steps"] and s["final_loss"] == s["losses"][-1]
    assert s["losses"][-1] < s["losses"][0] / 5
    assert s["restarts"] == 0 and s["resumed_from_step"] is None
    assert s["model_state_bytes_per_rank"] >= 16 * s["num_params"]  # fp32 params + grads + 2 Adam moments
    # the run directory holds config, metrics and a committed checkpoint
    run_dir = tmp_path / s["run_dir"]
    ckpt = tmp_path / s["checkpoint"]
    assert (ckpt / ".metadata").is_file() and (ckpt / "train_state.json").is_file()
    assert (ckpt.parent / "latest").read_text().strip() == ckpt.name
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["final"] and metrics[-1]["eval_accuracy"] == s["eval_accuracy"]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_human_summary_and_config_file(tmp_path: Path) -> None:
    (tmp_path / "run.toml").write_text(
        '[model]\nname = "mlp"\n[train]\nsteps = 6\nbatch_size = 16\n[strategy]\nname = "single"\n'
    )
    proc = run_cli(
        "train", "--config", "run.toml", "--set", "optimizer.lr=0.01", "--run-dir", "r", cwd=tmp_path
    )
    assert "eval accuracy" in proc.stdout and "single x 1" in proc.stdout
    saved = json.loads((tmp_path / "r" / "config.json").read_text())
    assert (
        saved["model"]["name"] == "mlp" and saved["optimizer"]["lr"] == 0.01 and saved["train"]["steps"] == 6
    )


def _assert_rejected_fast(tmp_path: Path, *args: str, needle: str) -> None:
    t0 = time.monotonic()
    proc = run_cli("train", *args, cwd=tmp_path, check=False, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") <= 3, "one clear message, not a traceback"
    assert not (tmp_path / "runs").exists(), "nothing may start (or be written) for a bad input"
    assert time.monotonic() - t0 < 30


_TEXT = ("--data", "python-stdlib", "--set", "data.max_bytes=20000", "--seq-len", "32", "--batch-size", "4")


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--strategy", "ddpp"), "unknown strategy 'ddpp'. Choose one of"),
        (("--model", "gpt7"), "unknown model 'gpt7'"),
        (("--data", "imagenet"), "unknown dataset 'imagenet'"),
        (("--batch-size", "0"), "train.batch_size must be positive"),
        (("--batch-size", "-4"), "train.batch_size must be positive"),
        (("--batch-size", "63"), "not divisible by data-parallel size 2"),
        (("--precision", "fp16", "--device", "cpu"), "fp16 needs a CUDA GPU"),
        (("--precision", "fp16", "--strategy", "zero2"), "fp16 does not work with strategy 'zero2'"),
        (("--set", "train.stepz=3"), "unknown key train.stepz"),
        (("--model", "cnn", "--data", "synthetic-regression"), "image inputs"),
        # a model and a dataset that do not fit: refused here, not by a dtype error inside the workers
        (
            ("--model", "llama-debug", "--data", "digits"),
            "'llama-debug' is a language model and needs a text",
        ),
        (("--model", "mlp", *_TEXT), "model 'mlp' takes tensor data, but 'python-stdlib' is a text dataset"),
        (("--model", "cnn", *_TEXT), "model 'cnn' takes tensor data"),  # it used to advise --model mlp
        # what a Llama model refused only inside the workers (exit 1 after launch)
        (
            ("--model", "llama-debug", *_TEXT, "--set", "model.max_seq_len=16"),
            "--seq-len 32 exceeds model.max_seq_len=16",
        ),
        (("--model", "llama2-7b", *_TEXT), "'llama2-7b' (6.7B parameters) is a shape-only preset"),
    ],
)
def test_bad_input_fails_before_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
    needle: str,
) -> None:  # fmt: skip
    if args in _AS_A_USER:
        _assert_rejected_fast(tmp_path, *args, needle=needle)
        return
    # The same refusal from ``paratrain.cli.main`` in this process (torch is imported already): the command
    # line, the checks and the message are the CLI's; only the interpreter start is shared.
    from paratrain.cli import main

    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    try:
        rc = main(["train", *args])
    except SystemExit as e:  # argparse's refusals
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err, err
    assert err.count("\n") <= 3, "one clear message, not a traceback"
    assert not (tmp_path / "runs").exists(), "nothing may start (or be written) for a bad input"
    assert time.monotonic() - t0 < 30


# run as a user runs them (a subprocess each): one refused by the parser, one by the launcher's preflight
_AS_A_USER = [("--strategy", "ddpp"), ("--model", "llama-debug", "--data", "digits")]


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_busy_explicit_port_is_rejected(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        _assert_rejected_fast(
            tmp_path, "--master-port", str(port), needle=f"port {port} on 127.0.0.1 is already in use"
        )


@pytest.mark.e2e
@pytest.mark.cuda
@pytest.mark.timeout(60)
def test_more_processes_than_gpus_is_rejected(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA machine: on CPU there is no GPU count to exceed")
    n = torch.cuda.device_count() + 1
    _assert_rejected_fast(tmp_path, "--nproc-per-node", str(n), needle="start at most one process per GPU")


@pytest.mark.e2e
@pytest.mark.cuda
@pytest.mark.timeout(90)
def test_launch_device_cpu_lifts_the_gpu_count_check(tmp_path: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA machine: on CPU there is no GPU count to exceed")
    n = torch.cuda.device_count() + 1
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\nsys.stdout.write('hello from rank ' + os.environ['RANK'] + '\\n')\n")
    refused = run_cli("launch", "--nproc-per-node", str(n), str(script), cwd=tmp_path, check=False)
    assert refused.returncode != 0 and "or run on the CPU with --device cpu" in refused.stderr, refused.stderr
    ran = run_cli("launch", "--device", "cpu", "--nproc-per-node", str(n), str(script), cwd=tmp_path)
    assert ran.stdout.count("hello from rank") == n, ran.stdout


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_failing_worker_is_reported_by_rank(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(
        "import os, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    raise ValueError('bad shard 17')\n"
        "time.sleep(2)\n"
    )
    # a plain script, no decorator: the exception of rank 1 is the root cause (not rank 0's SIGTERM from the
    # agent), named in the headline with its type, message and frame
    proc = run_cli("launch", "--nproc-per-node", "2", str(script), cwd=tmp_path, check=False)
    assert proc.returncode == 1
    report = proc.stderr[proc.stderr.index("paratrain launch: ") :]
    assert report.startswith("paratrain launch: rank 1 failed (exit code 1): ValueError: bad shard 17"), (
        proc.stderr
    )
    assert 'boom.py", line 3, in <module>' in report, proc.stderr
    # the rank's own traceback, as `python boom.py` prints it: no frame of paratrain's runner or of runpy
    assert "script_runner.py" not in proc.stderr and "runpy" not in proc.stderr, proc.stderr
    # the same module run as `launch -m boom` (the current directory importable, as under python -m)
    proc = run_cli("launch", "--nproc-per-node", "2", "-m", "boom", cwd=tmp_path, check=False)
    report = proc.stderr[proc.stderr.index("paratrain launch: ") :]
    assert proc.returncode == 1 and report.startswith(
        "paratrain launch: rank 1 failed (exit code 1): ValueError: bad shard 17"
    ), proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_worker_error_file_gives_message_and_frame(tmp_path: Path) -> None:
    script = tmp_path / "boom.py"
    script.write_text(
        "import os\n"
        "from paratrain.runtime import record_errors\n"
        "@record_errors\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('bad shard 17')\n"
        "main()\n"
    )
    proc = run_cli("launch", "--nproc-per-node", "2", str(script), cwd=tmp_path, check=False)
    assert proc.returncode == 1
    report = proc.stderr[proc.stderr.index("paratrain launch: ") :]
    assert "rank 1 failed (exit code 1): ValueError: bad shard 17" in report, proc.stderr
    assert 'boom.py", line 6, in main' in report
    assert "Traceback" not in proc.stderr  # one line per failing rank, not a wall of tracebacks


_BOTH_RAISE = (
    "import atexit, os, time\n"
    "from paratrain.runtime import record_errors\n"
    "FIRST = {first}\n"
    "@record_errors\n"
    "def main():\n"
    "    rank = int(os.environ['RANK'])\n"
    "    if rank != FIRST:\n"
    "        time.sleep(1.0)\n"
    "    if rank == 0:\n"
    "        atexit.register(time.sleep, 60)  # a teardown that hangs: the agent SIGTERMs it\n"
    "    raise ValueError(f'rank {rank} broke')\n"
    "main()\n"
)


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("first", [0, 1])
def test_headline_is_the_rank_that_raised_first(tmp_path: Path, first: int) -> None:
    """Both ranks raise; rank 0 then hangs in its teardown until the agent SIGTERMs it. The headline is the
    rank that raised first, and a rank that raised is never reported as "killed by signal SIGTERM"."""
    script = tmp_path / "both.py"
    script.write_text(_BOTH_RAISE.replace("{first}", str(first)))
    proc = run_cli("launch", "--nproc-per-node", "2", str(script), cwd=tmp_path, check=False)
    assert proc.returncode == 1
    report = proc.stderr[proc.stderr.index("paratrain launch: ") :]
    headline = report.splitlines()[0]
    if first == 0:
        assert "rank 0 failed: ValueError: rank 0 broke" in headline, proc.stderr
    else:
        assert "rank 1 failed (exit code 1): ValueError: rank 1 broke" in headline, proc.stderr
    assert "SIGTERM" not in headline, proc.stderr
    other = 1 - first
    assert f"ranks [{other}] stopped after it." in report, proc.stderr


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_checkpoint_dir_that_is_a_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "notadir").write_text("x")
    _assert_rejected_fast(tmp_path, "--ckpt-dir", "notadir", needle="exists and is not a directory")


def test_help_lists_commands(tmp_path: Path) -> None:
    proc = run_cli("--help", cwd=tmp_path)
    for cmd in ("train", "launch", "strategies", "bench"):
        assert cmd in proc.stdout
    proc = run_cli("strategies", "--json", cwd=tmp_path)
    names = set(json.loads(proc.stdout))
    assert {"single", "ddp"} <= names


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_metrics_log_the_learning_rate_each_step_used(tmp_path: Path) -> None:
    lr, warmup, steps = 0.004, 2, 5
    run_cli(
        "train", "--model", "mlp", "--strategy", "single", "--nproc-per-node", "1", "--steps", str(steps),
        "--batch-size", "16", "--lr", str(lr), "--set", "optimizer.schedule=cosine",
        "--set", f"optimizer.warmup_steps={warmup}", "--set", "train.log_every=1", "--run-dir", "r",
        cwd=tmp_path,
    )  # fmt: skip
    records = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    logged = [r["lr"] for r in records if "loss" in r]

    # step s (0-based) runs at lr * (s + 1) / warmup during the warm-up, then on the cosine from lr down to 0
    def used(s: int) -> float:
        if s < warmup:
            return lr * (s + 1) / warmup
        return lr * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))

    assert logged == pytest.approx([used(s) for s in range(steps)], rel=1e-9)
