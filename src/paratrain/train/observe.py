"""What the trainer reports to: the run's observers (metrics.jsonl, the experiment trackers, the profiler).

The trainer builds one :class:`RunObservers` on every rank and calls it:

- ``begin(step, total_steps)`` once before its loop (``step``: the step it resumed from, 0 for a fresh run);
- ``after_step(step)`` after every optimizer step (the profiler's schedule, ``--profile``);
- ``on_step_end(step, record)`` at every logging step (every ``log_every`` steps and the last), with the
  step's loss, learning rate, cumulative training seconds, and, when known, the gradient norm (with
  ``--set optimizer.grad_clip=...``, whose clip computes it) and the peak bytes of the measured step;
- ``on_eval(step, record)`` after each evaluation;
- ``close()`` at the end, on every rank (the profiler's summary gathers every rank's figures on rank 0).

The observers add the throughput of the interval since the previous logging step (``samples_per_s``,
and ``tokens_per_s`` for a language model) and rank 0's ``model_state_bytes``, then hand the record to
``metrics.jsonl`` (:class:`~paratrain.train.metrics.MetricsWriter`) and to the trackers of ``--tracker``
(``csv``, ``tensorboard``, ``mlflow``, ``wandb``: :mod:`paratrain.train.trackers`), which start their runs in
``begin`` (the config as hyperparameters). Only rank 0 writes. The only collective is the
profiler's one ``gather_object`` in ``close()``, and only with ``--profile``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from paratrain.config import RunConfig
from paratrain.runtime import Context, get_logger
from paratrain.train.metrics import MetricsWriter
from paratrain.train.profile import StepProfiler
from paratrain.train.trackers import build_trackers, check_trackers


class Observer(Protocol):
    def begin(self, step: int) -> None: ...

    def on_step_end(self, step: int, record: dict[str, Any]) -> None: ...

    def on_eval(self, step: int, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _Metrics:
    """``metrics.jsonl``: one JSON line per logging step and per evaluation."""

    def __init__(self, writer: MetricsWriter) -> None:
        self.writer = writer

    def begin(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        self.writer.write(record)

    def on_eval(self, step: int, record: dict[str, Any]) -> None:
        self.writer.write(record)

    def close(self) -> None:
        self.writer.close()


def preflight_observers(cfg: RunConfig) -> None:
    """Checks of the observability options that must fail before any worker starts: a tracker's package."""
    check_trackers(cfg.train)


class RunObservers:
    """Every observer of one run on this rank; see the module docstring."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: Context,
        run_dir: str | Path,
        metrics: MetricsWriter,
        memory: Callable[[], int] | None = None,
        tokens_per_sample: int | None = None,
    ) -> None:
        self.ctx = ctx
        self.strategy = cfg.strategy.name
        self.batch_size = cfg.train.batch_size
        self.tokens_per_sample = tokens_per_sample
        self.memory = memory
        self.observers: list[Observer] = [_Metrics(metrics)]
        if ctx.is_main:
            self.observers += build_trackers(cfg, run_dir, ctx.world_size, bool(tokens_per_sample))
        self.profiler = StepProfiler(cfg.train.profile, ctx, run_dir, get_logger(ctx))
        self._last = (0, 0.0)  # (step, training seconds) at the previous logging step

    def begin(self, step: int, total_steps: int) -> None:
        """Before the loop; ``step`` is the last step already done (resumed from), 0 for a fresh run."""
        self._last = (step, 0.0)
        self.profiler.begin(step, total_steps)
        for o in self.observers:
            o.begin(step)

    def after_step(self, step: int) -> None:
        """After every optimizer step, on every rank."""
        self.profiler.after_step(step)

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        """A logging step. ``record`` carries ``train_time_s`` (cumulative); tensors become floats."""
        if not self.ctx.is_main:  # only rank 0 writes: no .item() (a device sync) on the others
            return
        record = _plain(record)
        clock = record.get("train_time_s")
        if clock is not None:
            prev_step, prev_clock = self._last
            seconds = clock - prev_clock
            if step > prev_step and seconds > 0:
                rate = (step - prev_step) * self.batch_size / seconds
                record["samples_per_s"] = rate
                if self.tokens_per_sample:
                    record["tokens_per_s"] = rate * self.tokens_per_sample
            self._last = (step, clock)
        if self.memory is not None:
            record["model_state_bytes"] = int(self.memory())
        for o in self.observers:
            o.on_step_end(step, record)

    def on_eval(self, step: int, record: dict[str, Any]) -> None:
        if not self.ctx.is_main:
            return
        record = _plain(record)
        for o in self.observers:
            o.on_eval(step, record)

    def close(self) -> None:
        """At the end of the run, on every rank: the profiler's summary (collective), then the writers."""
        self.profiler.finish(self.strategy)
        for o in self.observers:
            o.close()


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` without ``None`` values, with 0-dim tensors as Python numbers."""
    out: dict[str, Any] = {}
    for k, v in record.items():
        if v is None:
            continue
        if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            v = v.item()
        out[k] = v
    return out
