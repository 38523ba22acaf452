"""``--tracker csv,tensorboard,mlflow,wandb``: every tracker's run read back with that tracker's own reader
(``csv.DictReader``, TensorBoard's ``EventAccumulator``, ``MlflowClient`` on the file store, the records of
W&B's offline ``.wandb`` file parsed with wandb's protobuf schema), a resumed run continuing the same
tracker runs, and the refusals before launch."""

from __future__ import annotations

import csv
import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from paratrain.config import RunConfig
from paratrain.errors import ConfigError
from paratrain.train import trackers
from paratrain.train.metrics import MetricsWriter
from paratrain.train.observe import RunObservers
from paratrain.train.trackers import check_trackers, tracker_names
from tests.unit.test_observe import ctx

pytestmark = pytest.mark.timeout(120)

ALL = [n for n, (module, _) in trackers.PACKAGES.items() if importlib.util.find_spec(module) is not None]
MOE = {"tokens_per_expert": [[3, 5]], "overload": 1.25, "dropped_fraction": 0.0, "aux_loss": 0.5}


def _run(run_dir: Path, names: str, start: int, steps: list[int]) -> None:
    """What the trainer hands the observers: begin, logging steps (loss 1/step), an evaluation, close."""
    cfg = RunConfig().override([f"train.tracker={names}", "train.batch_size=4", "optimizer.lr=0.05"])
    obs = RunObservers(cfg, ctx(), run_dir, MetricsWriter(run_dir / "metrics.jsonl"), memory=lambda: 99)
    obs.begin(start, steps[-1])
    for s in steps:
        obs.on_step_end(s, {"step": s, "loss": 1.0 / s, "lr": 0.05, "train_time_s": (s - start) * 0.5,
                            "grad_norm": None, "moe": MOE})  # fmt: skip
    obs.on_eval(steps[-1], {"step": steps[-1], "eval_accuracy": 0.75, "eval_loss": 0.5, "final": True})
    obs.close()


def _wandb_records(path: Path) -> list[Any]:
    """The records of a ``.wandb`` file: LevelDB log blocks of 32 KiB after a 7-byte ``:W&B`` header, each
    record's chunks behind a 7-byte (crc, length, type) header, parsed as wandb's own ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunk, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def test_names_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = RunConfig().override(["train.tracker=wandb, csv,csv", "train.tensorboard=true"])
    assert cfg.train.tracker == "wandb,csv" and tracker_names(cfg.train) == ("csv", "tensorboard", "wandb")
    with pytest.raises(ConfigError, match=r"tracker='neptune' is not valid"):
        RunConfig().override(["train.tracker=csv,neptune"])
    monkeypatch.setattr(
        trackers, "_import_problem", lambda module: "not installed" if module == "mlflow" else None
    )
    with pytest.raises(ConfigError, match=r"pip install mlflow-skinny==3\.17\.2 .*paratrain\[trackers\]"):
        check_trackers(RunConfig().override(["train.tracker=csv,mlflow"]).train)
    check_trackers(RunConfig().override(["train.tracker=csv,wandb"]).train)  # csv needs nothing


def test_every_tracker_reads_back_and_a_resume_continues_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_MODE", "WANDB_PROJECT"):
        monkeypatch.delenv(var, raising=False)
    names = ",".join(["csv", *ALL])
    _run(tmp_path, names, 0, [2, 4])
    resumed = names.replace(",wandb", "")  # W&B's resume: the test below
    _run(tmp_path, resumed, 4, [6])  # resumed after step 4 in the same run directory
    losses = {2: 0.5, 4: 0.25, 6: 1 / 6}

    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["train/loss"]]
    assert [(int(r["step"]), float(r["train/loss"])) for r in train] == list(losses.items())
    assert float(train[0]["throughput/samples_per_s"]) == pytest.approx(2 * 4 / 1.0)
    assert float(train[0]["moe/layer0/expert1"]) == 5 and "train/grad_norm" not in train[0]  # None: no column
    assert [(int(r["step"]), float(r["eval/loss"])) for r in rows if r.get("eval/loss")] == [
        (4, 0.5),
        (6, 0.5),
    ]
    hparams = json.loads((tmp_path / "csv" / "hparams.json").read_text())
    assert hparams["optimizer.lr"] == 0.05 and hparams["world_size"] == 1

    if "tensorboard" in ALL:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        from tensorboard.plugins.hparams import plugin_data_pb2

        acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
        acc.Reload()  # both launches' event files
        start = plugin_data_pb2.HParamsPluginData.FromString(
            acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        ).session_start_info
        assert start.hparams["optimizer.lr"].number_value == 0.05
        assert start.hparams["strategy.name"].string_value == "ddp"
        assert {e.step: e.value for e in acc.Scalars("train/loss")} == pytest.approx(losses)
        assert acc.Scalars("moe/overload")[0].value == 1.25

    if "mlflow" in ALL:
        from mlflow.tracking import MlflowClient

        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
        exp = client.get_experiment_by_name("paratrain")
        assert exp is not None
        (run,) = client.search_runs([exp.experiment_id])  # the resume continued the same run
        assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"
        assert run.data.params["optimizer.lr"] == "0.05" and run.data.params["train.tracker"] == names
        assert {
            m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")
        } == pytest.approx(losses)
        assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [4, 6]

    if "wandb" in ALL:
        history, config = _wandb_run(tmp_path, launches=1)
        assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == pytest.approx(
            {2: 0.5, 4: 0.25}
        )
        assert history[4]["eval/accuracy"] == 0.75 and history[2]["moe/aux_loss"] == 0.5
        assert (
            config["optimizer"]["lr"] == 0.05 and config["world_size"] == 1 and config["model"]["dim"] is None
        )


def _wandb_run(run_dir: Path, launches: int) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """The history rows (by step) and the config of the offline W&B run(s) under ``run_dir/wandb``."""
    offline = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (
        len(offline) == launches
    )  # one offline file per launch, with the same run id: `wandb sync` joins them
    assert len({p.name for p in offline}) == 1
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    for path in offline:
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
                }
                history.setdefault(items["_step"], {}).update(items)
            elif kind == "run":
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return history, config


def test_a_resumed_wandb_run_continues_the_same_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the trackers extra is not installed")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    _run(tmp_path, "wandb", 0, [2, 4])
    _run(tmp_path, "wandb", 4, [6])
    history, _ = _wandb_run(tmp_path, launches=2)
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == pytest.approx(
        {2: 0.5, 4: 0.25, 6: 1 / 6}
    )


def test_a_new_run_in_a_used_directory_starts_new_tracker_runs(tmp_path: Path) -> None:
    _run(tmp_path, "csv", 0, [2])
    _run(tmp_path, "csv", 0, [3])  # --resume never: step 0 again
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["3", "3"]  # the step, then the final evaluation
    assert len(list((tmp_path / "csv").glob("metrics-*.csv"))) == 1  # the old run's file is kept


def test_a_resume_after_a_crash_and_a_new_run_draw_each_step_once(tmp_path: Path) -> None:
    """A launch that logged steps 2..6 but saved at 4, resumed from 4: steps 5+ come from the second launch
    only; then ``--resume never`` in the same directory: the old runs are set aside, not drawn on one curve."""
    names = "csv,tensorboard" if "tensorboard" in ALL else "csv"
    _run(tmp_path, names, 0, [2, 4, 6])
    _run(tmp_path, names, 4, [5, 6])
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        train = [(int(r["step"]), float(r["train/loss"])) for r in csv.DictReader(f) if r["train/loss"]]
    assert train == [(2, 0.5), (4, 0.25), (5, 0.2), (6, 1 / 6)]
    if "tensorboard" in ALL:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        def steps(path: Path, tag: str = "train/loss") -> list[int]:
            acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
            acc.Reload()
            return [e.step for e in acc.Scalars(tag)]

        assert steps(tmp_path / "tensorboard") == [2, 4, 5, 6]  # the first launch's step 6 is purged
        assert steps(tmp_path / "tensorboard", "eval/loss") == [6]
        _run(tmp_path, names, 0, [3])  # --resume never
        assert steps(tmp_path / "tensorboard") == [3]
        (previous,) = (tmp_path / "tensorboard").glob("previous-*")
        assert steps(previous) == [2, 4, 5, 6]
