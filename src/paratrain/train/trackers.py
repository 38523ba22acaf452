"""``--tracker csv,tensorboard,mlflow,wandb``: experiment trackers, as Lightning's loggers are.

Every tracker receives the same things from rank 0 only (:class:`~paratrain.train.observe.RunObservers`
calls them; the other ranks build none):

- at the start, the run's config as hyperparameters (``section.key`` names, e.g. ``optimizer.lr``, plus
  ``world_size``);
- at every logging step (``--log-every``, default every 10 steps, and the last), the scalars of
  :func:`step_scalars`: ``train/loss``, ``train/lr``, ``train/grad_norm`` (with ``--set
  optimizer.grad_clip=...``), ``throughput/samples_per_s``, ``throughput/tokens_per_s`` (language models),
  ``memory/model_state_bytes``, ``memory/peak_bytes`` and, for mixture-of-experts models, ``moe/overload``,
  ``moe/dropped_fraction``, ``moe/aux_loss`` and ``moe/layer{i}/expert{e}``;
- after each evaluation, ``eval/loss``, ``eval/accuracy`` (classification), ``eval/perplexity`` (language
  models).

Where each writes (nothing needs a network by default):

- ``csv``: ``RUN_DIR/csv/metrics.csv`` (one row per step, a column per scalar, as Lightning's ``CSVLogger``)
  and ``RUN_DIR/csv/hparams.json``; standard library only.
- ``tensorboard``: event files in ``RUN_DIR/tensorboard/`` (:mod:`paratrain.train.tensorboard`), the
  hyperparameters in TensorBoard's HParams plugin.
- ``mlflow``: an MLflow run in experiment ``paratrain`` (or ``MLFLOW_EXPERIMENT_NAME``) of the local file
  store ``RUN_DIR/mlruns``, or of ``MLFLOW_TRACKING_URI`` when it is set (a server, ``sqlite:///...``).
  MLflow 3 keeps its file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE=true``, which is set for
  this store. View it with ``MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri RUN_DIR/mlruns``.
- ``wandb``: a Weights & Biases run in project ``paratrain`` (or ``WANDB_PROJECT``), offline under
  ``RUN_DIR/wandb/`` unless ``WANDB_MODE`` says otherwise; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it.

A run resumed from a checkpoint in the same run directory continues the same MLflow and W&B run (their ids
are kept in ``RUN_DIR/trackers.json``) and appends to ``metrics.csv``; a run that starts at step 0 starts
new ones. A tracker whose package is missing is refused before any worker starts (:func:`check_trackers`).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any

from paratrain.config import TRACKERS, RunConfig, TrainConfig
from paratrain.errors import ConfigError

PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard==2.21.0"),
    "mlflow": ("mlflow", "mlflow-skinny==3.17.2"),
    "wandb": ("wandb", "wandb==0.31.0"),
}
"""Tracker -> (module it imports, the pinned package that provides it; the ``trackers`` extra has them all)."""

_STEP_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "samples_per_s": "throughput/samples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "model_state_bytes": "memory/model_state_bytes",
    "peak_bytes": "memory/peak_bytes",
}
_EVAL_TAGS = {
    "eval_loss": "eval/loss",
    "eval_accuracy": "eval/accuracy",
    "eval_perplexity": "eval/perplexity",
}


def tracker_names(train: TrainConfig) -> tuple[str, ...]:
    """The trackers of a run: ``--tracker``'s names, and ``tensorboard`` for ``--tensorboard``."""
    names = [n for n in (train.tracker or "").split(",") if n]
    if train.tensorboard and "tensorboard" not in names:
        names.append("tensorboard")
    return tuple(n for n in TRACKERS if n in names)


def check_trackers(train: TrainConfig) -> None:
    """A :class:`ConfigError` before launch for each tracker whose package is not installed or does not import
    (a broken install, e.g. a conflicting dependency, is found here rather than on rank 0 mid-start)."""
    problems = {n: _import_problem(PACKAGES[n][0]) for n in tracker_names(train) if n in PACKAGES}
    missing = [n for n, why in problems.items() if why]
    if missing:
        pins = " ".join(PACKAGES[n][1] for n in missing)
        what = f"the {' and '.join(missing)} tracker" + ("s" if len(missing) > 1 else "")
        why = "; ".join(f"{n}: {problems[n]}" for n in missing)
        raise ConfigError(
            f"{what} (--tracker{', --tensorboard' if 'tensorboard' in missing else ''}) need(s) "
            f"{pins.replace(' ', ' and ')}, which cannot be imported ({why}). Install it with pip install {pins} "
            "(or pip install 'paratrain[trackers]' for every tracker), or run without it."
        )


def _import_problem(module: str) -> str | None:
    """Why ``module`` cannot be imported, or ``None`` when it imports."""
    try:
        if importlib.util.find_spec(module) is None:
            return "not installed"
        importlib.import_module(module)
    except Exception as e:  # any failure to import is a broken install: named in the refusal
        return f"{type(e).__name__}: {e}"
    return None


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of a logging step's record, by tag (see the module docstring)."""
    out = {tag: float(record[k]) for k, tag in _STEP_TAGS.items() if _finite(record.get(k))}
    moe = record.get("moe")
    if isinstance(moe, dict):  # flattened: moe/overload, moe/layer0/expert3, ...
        flat: dict[str, Any] = {f"moe/{k}": moe.get(k) for k in ("overload", "dropped_fraction", "aux_loss")}
        for i, counts in enumerate(moe.get("tokens_per_expert") or []):
            flat.update({f"moe/layer{i}/expert{e}": c for e, c in enumerate(counts)})
        out.update({k: float(v) for k, v in flat.items() if _finite(v)})
    return out


def eval_scalars(record: dict[str, Any], perplexity: bool) -> dict[str, float]:
    """The scalars of an evaluation's record; ``perplexity`` (a language model) adds exp(eval loss)."""
    loss: Any = record.get("eval_loss")
    if perplexity and _finite(loss):
        record = {**record, "eval_perplexity": math.exp(min(float(loss), 700.0))}
    return {tag: float(record[k]) for k, tag in _EVAL_TAGS.items() if _finite(record.get(k))}


def hyperparameters(cfg: RunConfig, world_size: int) -> dict[str, str | int | float | bool | None]:
    """The run's config as flat ``section.key`` hyperparameters (lists as JSON text)."""
    out: dict[str, str | int | float | bool | None] = {"world_size": world_size}
    for section, values in cfg.to_dict().items():
        for key, value in values.items():
            plain = value is None or isinstance(value, str | int | float | bool)
            out[f"{section}.{key}"] = value if plain else json.dumps(value)
    return out


class _Ids:
    """``RUN_DIR/trackers.json``: the MLflow and W&B run ids, so a resumed run continues the same runs."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / "trackers.json"

    def get(self, key: str) -> str | None:
        try:
            value = json.loads(self.path.read_text()).get(key)
        except (OSError, ValueError):
            return None
        return value if isinstance(value, str) else None

    def put(self, key: str, value: str) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = {}
        data[key] = value
        self.path.write_text(json.dumps(data, indent=1) + "\n")


class Tracker:
    """One tracker on rank 0: ``begin`` (hyperparameters; ``step`` > 0 resumes), scalars, ``close``."""

    def __init__(self, run_dir: Path, params: dict[str, Any], perplexity: bool) -> None:
        self.run_dir = run_dir
        self.params = params
        self.perplexity = perplexity

    def begin(self, step: int) -> None:
        raise NotImplementedError

    def log(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        scalars = step_scalars(record)
        if scalars:
            self.log(step, scalars)

    def on_eval(self, step: int, record: dict[str, Any]) -> None:
        scalars = eval_scalars(record, self.perplexity)
        if scalars:
            self.log(step, scalars)

    def close(self) -> None:
        pass


class CSVTracker(Tracker):
    """``RUN_DIR/csv/metrics.csv``: a ``step`` column and one per scalar; rewritten when a new one appears."""

    def begin(self, step: int) -> None:
        self.dir = self.run_dir / "csv"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        if self.path.is_file() and self.path.stat().st_size:
            if step > 0:  # resumed: continue the file, without what a crashed launch logged after `step`
                with open(self.path, newline="") as f:
                    self.rows = [r for r in csv.DictReader(f) if _step_of(r) <= step]
            else:  # a new run in a used directory keeps the old file
                stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.path.stat().st_mtime))
                os.replace(self.path, self.dir / f"metrics-{stamp}.csv")
        self.columns = ["step", *dict.fromkeys(k for r in self.rows for k in r if k != "step")]
        if self.rows:
            self._rewrite()
        (self.dir / "hparams.json").write_text(json.dumps(self.params, indent=1) + "\n")

    def log(self, step: int, scalars: dict[str, float]) -> None:
        row = {"step": step, **scalars}
        self.rows.append(row)
        new = [k for k in scalars if k not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            self._rewrite()
        else:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def _rewrite(self) -> None:
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self.rows)


def _step_of(row: dict[str, Any]) -> int:
    try:
        return int(row.get("step") or 0)
    except ValueError:
        return 0


class MLflowTracker(Tracker):
    """An MLflow run through ``MlflowClient`` (no global active run: nothing leaks into the user's code)."""

    def begin(self, step: int) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (self.run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        ids = _Ids(self.run_dir)
        run_id = ids.get("mlflow_run_id") if step > 0 else None
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "paratrain")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
        self.run_id = self.client.create_run(exp_id, run_name=self.run_dir.name).info.run_id
        ids.put("mlflow_run_id", self.run_id)
        params = [Param(k, str(v)) for k, v in self.params.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker(Tracker):
    """A W&B run, offline under ``RUN_DIR/wandb/`` unless ``WANDB_MODE`` is set; it does not capture the
    console (the workers' output goes to ``logs/``)."""

    def begin(self, step: int) -> None:
        import wandb

        nested: dict[str, Any] = {}
        for key, value in self.params.items():
            section, _, name = key.partition(".")
            if name:
                nested.setdefault(section, {})[name] = value
            else:
                nested[key] = value
        ids = _Ids(self.run_dir)
        run_id = ids.get("wandb_run_id") if step > 0 else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "paratrain"),
            name=self.run_dir.name,
            dir=str(self.run_dir),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            config=nested,
            id=run_id,
            resume="allow" if run_id else None,
            settings=wandb.Settings(console="off", silent=True),
        )
        ids.put("wandb_run_id", self.run.id)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # wandb-core may still be writing the offline file; a worker ends with os._exit (no atexit hooks),
        # so stop the service here, which waits for it
        wandb.teardown()


class TensorBoardTracker(Tracker):
    """TensorBoard event files; the writer itself is :class:`paratrain.train.tensorboard.TensorBoardWriter`."""

    def begin(self, step: int) -> None:
        from paratrain.train.tensorboard import TensorBoardWriter

        self.writer = TensorBoardWriter(self.run_dir / "tensorboard", self.params, step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.writer.scalars(step, scalars)

    def close(self) -> None:
        self.writer.close()


_CLASSES: dict[str, type[Tracker]] = {
    "csv": CSVTracker,
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
}


def build_trackers(
    cfg: RunConfig, run_dir: str | Path, world_size: int, perplexity: bool = False
) -> list[Tracker]:
    """The run's trackers (call on rank 0 only); each starts its run in ``begin(step)``."""
    params = hyperparameters(cfg, world_size)
    return [_CLASSES[n](Path(run_dir), params, perplexity) for n in tracker_names(cfg.train)]
