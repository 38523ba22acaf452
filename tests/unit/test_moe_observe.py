"""The ``moe`` record of a step reaches TensorBoard as scalars (``moe/overload``, ``moe/layer0/expert1``, ...)."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain.config import RunConfig
from paratrain.train.metrics import MetricsWriter
from paratrain.train.observe import RunObservers
from tests.unit.test_observe import ctx

pytestmark = pytest.mark.timeout(60)


def test_moe_scalars_in_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = RunConfig().override(["train.tensorboard=true", "train.batch_size=4"])
    obs = RunObservers(cfg, ctx(), tmp_path, MetricsWriter(tmp_path / "m.jsonl"))
    obs.begin(0, 2)
    moe = {"tokens_per_expert": [[3, 5], [8, 0]], "overload": 2.0, "dropped_fraction": 0.0, "aux_loss": 0.5}
    obs.on_step_end(2, {"step": 2, "loss": 2.0, "lr": 0.1, "train_time_s": 1.0, "moe": moe})
    obs.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"moe/overload", "moe/dropped_fraction", "moe/aux_loss", "moe/layer1/expert0"} <= tags
    assert [(e.step, e.value) for e in acc.Scalars("moe/layer1/expert0")] == [(2, 8.0)]
    assert acc.Scalars("moe/overload")[0].value == 2.0


def test_plot_draws_expert_load(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import json

    from paratrain.diagnose.plot import draw, load_run

    run = tmp_path / "run"
    run.mkdir()
    lines = [{"step": s, "loss": 3.0 - s / 10, "moe": {"tokens_per_expert": [[s, 8 - s], [4, 4]],
                                                       "overload": 1 + s / 8}} for s in range(1, 4)]  # fmt: skip
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    loaded = load_run(run)
    assert loaded["moe_step"] == [1, 2, 3] and loaded["moe_overload"][-1] == 1 + 3 / 8
    assert loaded["moe_tokens_per_expert"] == [[3, 5], [4, 4]]
    draw([loaded], tmp_path / "out.png", (800, 600))
    assert (tmp_path / "out.png").stat().st_size > 1000
