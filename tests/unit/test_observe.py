"""Observers of a run without a process group: the options, metrics.jsonl records with throughput,
TensorBoard scalars read back, the rank log's tee and the rank-aware console."""

from __future__ import annotations

import argparse
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from paratrain.config import TRAIN, RunConfig, add_arguments, apply_arguments
from paratrain.errors import ConfigError
from paratrain.runtime import Context, get_logger
from paratrain.train.logs import _Tee
from paratrain.train.metrics import MetricsWriter, read_metrics
from paratrain.train.observe import RunObservers
from paratrain.train.profile import StepProfiler


def ctx(rank: int = 0, world: int = 1) -> Context:
    return Context(rank, rank, world, world, torch.device("cpu"), None, 60.0)


@pytest.mark.parametrize("spec", ["5-8", "8:5", "0:3", "a:b", ":4", "3:"])
def test_profile_option_refuses_bad_ranges(spec: str) -> None:
    with pytest.raises(ConfigError, match="START:END"):
        RunConfig().override([f"train.profile={spec}"])


def test_profile_beyond_the_run_is_refused() -> None:
    with pytest.raises(ConfigError, match="only 10 steps"):
        RunConfig().override(["train.steps=10", "train.profile=12:14"])
    assert RunConfig().override(["train.steps=10", "train.profile=5:20"]).train.profile == "5:20"


def test_flags_and_set_spellings() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p, TRAIN)
    cfg = apply_arguments(RunConfig(), p.parse_args(["--profile", "5:8", "--tensorboard"]), TRAIN)
    assert cfg.train.profile == "5:8" and cfg.train.tensorboard is True
    assert RunConfig().override(["train.tensorboard=true"]).train.tensorboard is True


def test_records_get_throughput_memory_and_plain_numbers(tmp_path: Path) -> None:
    cfg = RunConfig().override(["train.batch_size=32", "train.steps=10"])
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    obs = RunObservers(cfg, ctx(), tmp_path, writer, memory=lambda: 1234, tokens_per_sample=8)
    obs.begin(0, 10)
    for step in range(1, 11):
        obs.after_step(step)
        if step % 5 == 0:
            obs.on_step_end(step, {"step": step, "loss": 1.0 / step, "train_time_s": step * 0.5,
                                   "grad_norm": torch.tensor(2.5), "peak_bytes": None})  # fmt: skip
    obs.on_eval(10, {"step": 10, "eval_accuracy": None, "eval_loss": 0.5, "final": True})
    obs.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [5, 10]  # one record per logging step
    for r in steps:
        assert r["samples_per_s"] == pytest.approx(5 * 32 / 2.5)
        assert r["tokens_per_s"] == pytest.approx(8 * 5 * 32 / 2.5)
        assert r["grad_norm"] == 2.5 and r["model_state_bytes"] == 1234
        assert "peak_bytes" not in r  # None values are left out
    assert records[-1]["final"] and "eval_accuracy" not in records[-1]


def test_resumed_run_measures_from_its_first_step(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    obs = RunObservers(RunConfig().override(["train.batch_size=10"]), ctx(), tmp_path, writer)
    obs.begin(20, 30)  # resumed after step 20; the training clock starts at 0 again
    obs.on_step_end(30, {"step": 30, "loss": 1.0, "train_time_s": 2.0})
    obs.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["samples_per_s"] == pytest.approx(10 * 10 / 2.0)


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = RunConfig().override(["train.tensorboard=true", "train.batch_size=4"])
    obs = RunObservers(cfg, ctx(), tmp_path, MetricsWriter(tmp_path / "m.jsonl"), memory=lambda: 99)
    obs.begin(0, 4)
    obs.on_step_end(2, {"step": 2, "loss": 2.0, "lr": 0.1, "train_time_s": 1.0, "grad_norm": 3.0})
    obs.on_step_end(4, {"step": 4, "loss": 1.0, "lr": 0.1, "train_time_s": 2.0, "peak_bytes": 500})
    obs.on_eval(4, {"step": 4, "eval_accuracy": 0.5, "eval_loss": 0.7, "final": True})
    obs.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == {"train/loss", "train/lr", "train/grad_norm", "throughput/samples_per_s",
                    "memory/model_state_bytes", "memory/peak_bytes", "eval/loss", "eval/accuracy"}  # fmt: skip
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(2, 2.0), (4, 1.0)]
    assert [e.step for e in acc.Scalars("train/grad_norm")] == [2]
    assert acc.Scalars("throughput/samples_per_s")[-1].value == pytest.approx(2 * 4 / 1.0)


def test_tee_prefixes_other_ranks_and_keeps_whole_lines(tmp_path: Path) -> None:
    console, f = io.StringIO(), open(tmp_path / "rank1.log", "w")
    tee = _Tee(console, f, "[rank 1] ")
    tee.write("warning: ")
    tee.write("something\n[rank 1] already named\n")
    tee.write("\rtrain 10%\rtrain 100%")  # a progress bar: only its last state reaches the file
    tee.write("\n")
    tee.flush()
    f.close()
    assert console.getvalue().splitlines()[:2] == ["[rank 1] warning: something", "[rank 1] already named"]
    assert (tmp_path / "rank1.log").read_text().splitlines() == [
        "warning: something",
        "[rank 1] already named",
        "train 100%",
    ]


@pytest.fixture
def paratrain_logger() -> Iterator[logging.Logger]:
    log = logging.getLogger("paratrain")
    saved = list(log.handlers)
    yield log
    for h in list(log.handlers):
        if h not in saved:
            log.removeHandler(h)
    get_logger(ctx(0))  # the console handler back to rank 0's format


def test_console_shows_rank0_and_prefixed_warnings_of_others(
    paratrain_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    log = get_logger(ctx(1, 2))
    console = next(h for h in log.handlers if h.get_name() == "paratrain-console")
    stream = io.StringIO()
    old = console.setStream(stream)  # type: ignore[attr-defined]
    file_stream = io.StringIO()
    log.addHandler(logging.StreamHandler(file_stream))
    try:
        log.info("an info line")
        log.warning("a warning")
    finally:
        console.setStream(old)  # type: ignore[attr-defined]
    assert stream.getvalue() == "[rank 1] [paratrain WARNING] a warning\n"
    assert file_stream.getvalue() == "an info line\na warning\n"  # the rank's file keeps every record
    get_logger(ctx(0))
    stream = io.StringIO()
    old = console.setStream(stream)  # type: ignore[attr-defined]
    try:
        log.info("rank 0 info")
    finally:
        console.setStream(old)  # type: ignore[attr-defined]
    assert stream.getvalue() == "[paratrain INFO] rank 0 info\n"


@pytest.mark.parametrize(("resumed", "expected"), [(0, [2, 3]), (2, [3, 3])])
def test_profiler_records_the_run_s_own_step_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], resumed: int, expected: list[int]
) -> None:
    import json

    prof = StepProfiler("2:3", ctx(), tmp_path, logging.getLogger("test"))
    prof.begin(resumed, 5)
    x = torch.randn(64, 64)
    for step in range(resumed + 1, 6):
        with torch.profiler.record_function("paratrain.forward_backward"):
            x = (x @ x).tanh()
        prof.after_step(step)
    summary = prof.finish("single")
    assert summary is not None and summary["profiled_steps"] == expected
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == [f"ProfilerStep#{n}" for n in range(expected[0], expected[1] + 1)]
    assert summary["ranks"][0]["compute_ms"] > 0 and summary["ranks"][0]["comm_ms"] == 0
    assert json.loads((tmp_path / "profile" / "summary.json").read_text()) == summary
    assert "paratrain profile: steps" in capsys.readouterr().err


def test_profiler_window_already_passed_profiles_nothing(tmp_path: Path) -> None:
    prof = StepProfiler("2:3", ctx(), tmp_path, logging.getLogger("test"))
    prof.begin(4, 10)  # resumed after the window
    prof.after_step(5)
    assert prof.finish() is None and not (tmp_path / "profile").exists()


def test_plot_reads_a_damaged_metrics_file(tmp_path: Path) -> None:
    """Undecodable bytes and cut lines in metrics.jsonl cost their own lines, not the plot."""
    from paratrain.diagnose.plot import load_run

    (tmp_path / "metrics.jsonl").write_bytes(
        b'{"step": 1, "loss": 2.0}\n\xff\xfe garbage\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo'
    )
    run = load_run(tmp_path)
    assert run["step"] == [1, 2] and run["loss"] == [2.0, 1.5]


def test_plot_draws_each_step_once_after_a_resume(tmp_path: Path) -> None:
    """A launch logged steps 1-3 and crashed after its save at 2; the resumed launch logs 3 and 4 again."""
    from paratrain.diagnose.plot import load_run

    lines = [{"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.0}, {"step": 3, "loss": 2.5},
             {"step": 2, "eval_loss": 3.1}, {"step": 3, "loss": 2.0}, {"step": 4, "loss": 1.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = load_run(tmp_path)
    assert run["step"] == [1, 2, 3, 4] and run["loss"] == [4.0, 3.0, 2.0, 1.0]
