"""What a run prints without a terminal (a pipe, as under Slurm, nohup or CI): a header with the effective
settings, a progress line every ``--log-every`` steps with loss, learning rate, throughput and ETA, evaluation
progress, and the same lines in ``logs/rank0.log``; ``--keep-best`` keeps the best evaluated checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli

pytestmark = pytest.mark.e2e

LINE = re.compile(
    r"\[paratrain\] step (\d+)/12 \(\d+%\)  loss [\d.]+  lr [\d.e+-]+  [\d,]+ samples/s  elapsed"
)


@pytest.mark.timeout(300)
def test_a_pipe_gets_a_header_progress_lines_and_eval_progress(tmp_path: Path) -> None:
    run = tmp_path / "r"
    proc = run_cli("train", "--model", "mlp", "--set", "model.hidden=16", "--steps", "12", "--nproc-per-node", "2",
                   "--log-every", "4", "--eval-every", "6", "--eval-batches", "2", "--batch-size", "32",
                   "--keep-best", "--set", "checkpoint.keep_last=1", "--json", "--run-dir", str(run),
                   cwd=tmp_path, timeout=280)  # fmt: skip
    err = proc.stderr
    assert (
        "ddp (dp_replicate 2) on 2 process(es); global batch 32 = micro-batch 16 x 2 data-parallel" in err
    ), err
    assert "12 steps (0.267 epochs); fp32; digits: 1,438 train / 359 test samples" in err, err
    steps = [int(m.group(1)) for m in LINE.finditer(err)]
    assert steps == [4, 8, 12], err
    assert "ETA" in next(line for line in err.splitlines() if "step 4/12" in line)
    assert err.count("evaluating on 64 of 359 test samples (--eval-batches)") == 2, err  # step 6 and the end
    assert re.search(r"step 6: eval loss [\d.]+, accuracy [\d.]+%", err), err
    log = (run / "logs" / "rank0.log").read_text()
    for line in err.splitlines():
        if LINE.search(line) or "global batch" in line:
            assert line in log, line
    summary = last_json(proc.stdout)
    # --keep-best: `best` names a kept checkpoint holding the lowest eval loss seen (steps 6 and 12)
    evals = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval_loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    best = min(evals, key=lambda r: r["eval_loss"])
    name, loss = (run / "checkpoints" / "best").read_text().split()
    assert name == f"step_{best['step']:08d}" and float(loss) == pytest.approx(best["eval_loss"])
    assert (run / "checkpoints" / name / ".metadata").is_file()
    assert summary["eval_loss"] == pytest.approx(evals[-1]["eval_loss"])


@pytest.mark.timeout(300)
def test_without_log_every_the_first_steps_set_the_cadence(tmp_path: Path) -> None:
    proc = run_cli("train", "--strategy", "single", "--model", "mlp", "--set", "model.hidden=16", "--steps", "8",
                   "--set", "checkpoint.save_at_end=false", "--run-dir", str(tmp_path / "r"),
                   cwd=tmp_path, timeout=280)  # fmt: skip
    err = proc.stderr
    assert re.search(r"first steps timed: [\d.e+-]+ s/step, about \d+:\d\d for the 5 steps left", err), err
    assert [int(m.group(1)) for m in re.finditer(r"\] step (\d+)/8 ", err)][-1] == 8, err
