"""Small things a user meets: a bad flag is two lines, the human summary says how the run ran, ``--resume
never`` starts a new metrics file, the license metadata is an SPDX expression."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from paratrain.cli import _print_summary, main
from paratrain.config import RunConfig
from paratrain.launch.train_job import start_new_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_a_bad_value_is_two_lines_not_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["train", "--steps", "abc"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["paratrain train: error: argument --steps: expected an integer, got 'abc'",
                   "(see paratrain train --help)"]  # fmt: skip


def test_human_summary_has_wall_time_precision_comm_and_restarts(capsys: pytest.CaptureFixture[str]) -> None:
    _print_summary({"strategy": "dp", "world_size": 2, "num_params": 10, "steps": 3, "final_loss": 1.0,
                    "eval_accuracy": 0.5, "eval_loss": 1.0, "samples_per_s": 9.0, "model_state_bytes_per_rank": 1024,
                    "checkpoint": "c", "param_sha256": "ab" * 32, "precision": "bf16", "comm_algorithm": "ring",
                    "wall_time_s": 12.34, "train_time_s": 3.21, "restarts": 1, "eval_perplexity": 2.72})  # fmt: skip
    out = capsys.readouterr().out
    assert "bf16, ring collectives" in out and "12.3 s wall, 3.2 s training" in out
    assert out.splitlines()[3].split() == ["restarts", "1"]
    lines = out.splitlines()
    assert lines.index(next(x for x in lines if "eval perplexity" in x)) == 1 + lines.index(
        next(x for x in lines if "eval loss" in x)
    )


def test_resume_never_starts_a_new_metrics_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = RunConfig()
    start_new_metrics(tmp_path, cfg)  # resume auto: the run continues its curve
    assert (tmp_path / "metrics.jsonl").is_file()
    cfg.checkpoint.resume = "never"
    start_new_metrics(tmp_path, cfg)
    assert not (tmp_path / "metrics.jsonl").exists()
    kept = list(tmp_path.glob("metrics-*.jsonl"))
    assert len(kept) == 1 and kept[0].read_text() == '{"step": 1}\n'


def test_license_is_an_spdx_expression() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
