"""Seeing a run, as a user does: ``--profile`` traces and table, TensorBoard, metrics.jsonl, ``paratrain
plot``, ``bench scaling`` and the per-rank logs of a failed run (docs/observability.md).

The default tier runs one profiled ``ddp`` run on 2 ranks and checks everything it writes; ``slow`` repeats
that with ``single`` next to it, ``paratrain plot``, ``bench scaling`` and a failed run."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cli_env, last_json, run_cli

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
COMMON = ("--model", "mlp", "--steps", "6", "--batch-size", "32", "--profile", "3:4",
          "--set", "train.log_every=2", "--set", "checkpoint.save_at_end=false")  # fmt: skip


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_one_profiled_ddp_run_writes_traces_metrics_and_per_rank_logs(tmp_path: Path) -> None:
    extra = ["--tensorboard"] if HAVE_TENSORBOARD else []
    proc = run_cli("train", "--model", "mlp", "--steps", "4", "--batch-size", "32", "--profile", "2:3",
                   "--set", "train.log_every=2", "--set", "checkpoint.save_at_end=false", "--strategy", "ddp",
                   "--nproc-per-node", "2", "--run-dir", "ddp", "--tracker", "csv", *extra, "--json", cwd=tmp_path,
                   timeout=200)  # fmt: skip
    run, summary = tmp_path / "ddp", last_json(proc.stdout)
    assert "paratrain profile: steps 2-3" in proc.stderr and summary["world_size"] == 2
    for r in range(2):
        trace = json.loads((run / "profile" / f"rank{r}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"ProfilerStep#2", "ProfilerStep#3", "paratrain.forward_backward"} <= names
    prof = json.loads((run / "profile" / "summary.json").read_text())
    assert prof["profiled_steps"] == [2, 3] and [r["rank"] for r in prof["ranks"]] == [0, 1]
    for r in prof["ranks"]:
        assert r["steps"] == 2 and r["compute_ms"] > 0 and r["comm_ms"] > 0
        assert r["comm_exposed_ms"] + r["comm_overlapped_ms"] == pytest.approx(r["comm_ms"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4]
    assert [r["loss"] for r in logged] == pytest.approx([summary["losses"][i] for i in (1, 3)])
    assert records[-1]["final"] and records[-1]["eval_accuracy"] == summary["eval_accuracy"]
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    if HAVE_TENSORBOARD:
        assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1, "rank 0 only"
    with open(run / "csv" / "metrics.csv", newline="") as f:  # --tracker csv: the same losses
        rows = [r for r in csv.DictReader(f) if r["train/loss"]]
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert [float(r["train/loss"]) for r in rows] == pytest.approx([summary["losses"][i] for i in (1, 3)])
    assert json.loads((run / "csv" / "hparams.json").read_text())["world_size"] == 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two short profiled runs: ``single`` (world size 1) and ``ddp`` over 2 ranks (with --tensorboard)."""
    root = tmp_path_factory.mktemp("observability")
    single = run_cli(
        "train", *COMMON, "--strategy", "single", "--run-dir", "single", "--json", cwd=root, timeout=240
    )
    extra = ["--tensorboard"] if HAVE_TENSORBOARD else []
    ddp = run_cli("train", *COMMON, "--strategy", "ddp", "--nproc-per-node", "2", "--run-dir", "ddp",
                  "--set", "optimizer.grad_clip=1.0", *extra, "--json", cwd=root, timeout=240)  # fmt: skip
    return {"root": root, "single": single, "ddp": ddp}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(540)
def test_profile_writes_a_trace_per_rank_and_a_summary(runs: dict[str, Any]) -> None:
    root = runs["root"]
    for name, world in (("single", 1), ("ddp", 2)):
        proc = runs[name]
        assert "paratrain profile: steps 3-4" in proc.stderr, proc.stderr
        assert last_json(proc.stdout)["world_size"] == world  # the --json line stays last on stdout
        for r in range(world):
            with open(root / name / "profile" / f"rank{r}.json") as f:
                trace = json.load(f)
            names = {e.get("name") for e in trace["traceEvents"]}
            assert {"ProfilerStep#3", "ProfilerStep#4", "paratrain.forward_backward"} <= names
        summary = json.loads((root / name / "profile" / "summary.json").read_text())
        assert summary["profiled_steps"] == [3, 4] and summary["world_size"] == world
        assert [r["rank"] for r in summary["ranks"]] == list(range(world))
        assert summary["slowest_rank"] in range(world) and summary["slowest_gap_ms"] >= 0
        for r in summary["ranks"]:
            assert r["steps"] == 2 and r["step_ms"] > 0 and r["compute_ms"] > 0
            assert r["comm_exposed_ms"] + r["comm_overlapped_ms"] == pytest.approx(r["comm_ms"])
            if world == 1:
                assert r["comm_ms"] == 0
            else:
                assert r["comm_ms"] > 0  # DDP's gradient all-reduce and the stop agreement


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(540)
def test_metrics_hold_one_record_per_logging_step(runs: dict[str, Any]) -> None:
    lines = (runs["root"] / "ddp" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    logged = [r for r in records if "loss" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    assert all(r["samples_per_s"] > 0 and r["grad_norm"] > 0 and r["model_state_bytes"] > 0 for r in logged)
    summary = last_json(runs["ddp"].stdout)
    assert [r["loss"] for r in logged] == pytest.approx([summary["losses"][i] for i in (1, 3, 5)])
    assert records[-1]["final"] and records[-1]["eval_accuracy"] == summary["eval_accuracy"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(540)
def test_tensorboard_events_read_back(runs: dict[str, Any]) -> None:
    if not HAVE_TENSORBOARD:
        pytest.skip("the tensorboard extra is not installed (pip install 'paratrain[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = runs["root"] / "ddp" / "tensorboard"
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 1, "rank 0 only"
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {"train/loss", "train/lr", "train/grad_norm", "throughput/samples_per_s",
                "memory/model_state_bytes", "memory/peak_bytes", "eval/loss", "eval/accuracy"}  # fmt: skip
    assert expected <= tags, expected - tags
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6]
    assert [e.step for e in acc.Scalars("eval/accuracy")] == [6]
    losses = last_json(runs["ddp"].stdout)["losses"]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(
        [losses[i] for i in (1, 3, 5)], rel=1e-6
    )


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(540)
def test_plot_draws_two_runs(runs: dict[str, Any]) -> None:
    import matplotlib.image

    root = runs["root"]
    proc = run_cli("plot", "single", "ddp", "-o", "compare.png", "--size", "900x700", "--json", cwd=root)
    out = last_json(proc.stdout)
    assert [r["label"] for r in out["runs"]] == ["single x1", "ddp x2"]
    assert matplotlib.image.imread(root / "compare.png").shape[:2] == (700, 900)
    bad = run_cli("plot", "nowhere", cwd=root, check=False)
    assert bad.returncode == 2 and "has no metrics.jsonl" in bad.stderr


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(540)
def test_every_rank_writes_its_log(runs: dict[str, Any]) -> None:
    logs = runs["root"] / "ddp" / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.log", "rank1.log"]
    assert "sync-batchnorm" in (logs / "rank1.log").read_text()  # rank 1's INFO lines: file only
    assert "sync-batchnorm" in runs["ddp"].stderr  # rank 0's on the console


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_failed_run_keeps_every_rank_log(tmp_path: Path) -> None:
    proc = run_cli("train", "--model", "mlp", "--steps", "6", "--batch-size", "32", "--run-dir", "r",
                   "--fail-at-step", "2", "--fail-rank", "1", "--timeout", "60", cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert (
        "[rank 1] [paratrain] fault injection: rank 1 kills itself" in proc.stderr
    )  # prefixed on the console
    logs = tmp_path / "r" / "logs"
    rank0, rank1 = (logs / "rank0.log").read_text(), (logs / "rank1.log").read_text()
    assert "fault injection: rank 1 kills itself (SIGKILL) at step 2" in rank1
    # the survivor's uncaught error names the dead rank, with its traceback
    assert "PeerLostError" in rank0 and "rank 1" in rank0 and "Traceback" in rank0


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_bench_scaling_json_has_one_row_per_world_size(tmp_path: Path) -> None:
    proc = run_cli("bench", "scaling", "--model", "mlp", "--steps", "4", "--batch-size", "16", "--nproc", "1,2",
                   "--run-dir", "sc", "--json", cwd=tmp_path, timeout=280)  # fmt: skip
    out = last_json(proc.stdout)
    assert out["mode"] == "weak" and [r["world_size"] for r in out["rows"]] == [1, 2]
    assert [r["global_batch"] for r in out["rows"]] == [16, 32]  # weak: a fixed batch per rank
    assert out["rows"][0]["speedup"] == 1.0 and out["rows"][0]["efficiency"] == 1.0
    assert all(r["samples_per_s"] > 0 for r in out["rows"])
    assert proc.stderr.count("bench scaling: world size") == 2  # a progress line per world size
    assert (tmp_path / "sc" / "n2" / "metrics.jsonl").is_file()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_tensorboard_missing_is_refused_before_launch(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "tensorboard"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'tensorboard'\")\n")
    env = cli_env()
    env["PYTHONPATH"] = str(tmp_path / "shadow")
    proc = subprocess.run([sys.executable, "-m", "paratrain", "train", "--model", "mlp", "--steps", "2",
                           "--tensorboard"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "ImportError: No module named 'tensorboard'" in proc.stderr  # why, named
    assert "pip install tensorboard==" in proc.stderr and "paratrain[trackers]" in proc.stderr
    assert "[rank " not in proc.stderr, "refused before any worker starts"
    assert not (tmp_path / "runs").exists()
