"""What rank 0 prints while a run trains: one header with the effective settings, then progress lines.

A person at a terminal gets tqdm's bar (``train.progress``); everywhere else (Slurm, ``nohup``, CI, a pipe
into ``tee``) rank 0 prints one plain line every ``--log-every N`` steps, as Lightning and the Hugging Face
Trainer do without a TTY::

    [paratrain] step 30/120 (25%)  loss 2.3104  lr 3.00e-03  1,520 samples/s  elapsed 0:06  ETA 0:18

The lines go to ``sys.stderr``, which a worker tees into ``RUN_DIR/logs/rank0.log``
(:mod:`paratrain.train.logs`), so the log file holds the same lines.

Without ``--log-every`` the cadence follows wall time: after the first steps are timed, rank 0's seconds
per step are broadcast (one collective, once, at the same step on every rank) and every rank logs every
``round(10 s / step time)`` steps. Logging needs the global loss, an all-reduce that every rank must join at
the same step, so the cadence is decided from one clock (rank 0's) rather than from each rank's own.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from paratrain.runtime import Context

TARGET_S = 10.0
"""Wall seconds between two progress lines when ``--log-every`` is not given."""
CALIBRATE_AFTER = 3
"""Steps timed (the first is a warm-up) before the cadence and the duration estimate are decided."""


def duration(seconds: float) -> str:
    """``H:MM:SS`` (or ``M:SS`` under an hour)."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ConsoleLog:
    """Rank 0's header and progress lines; every rank holds one so that the cadence is agreed."""

    def __init__(
        self,
        ctx: Context,
        *,
        every: int | None,
        lines: bool,
        start_step: int,
        total_steps: int,
        batch_size: int,
        tokens_per_sample: int | None,
    ) -> None:
        self.ctx = ctx
        self.every = every
        """Steps between two progress lines; ``None`` until calibrated when ``--log-every`` was not given."""
        self.lines = lines and ctx.is_main
        self.start = start_step
        self.total = total_steps
        self.batch_size = batch_size
        self.tokens_per_sample = tokens_per_sample
        self.calibrate_at = min(start_step + CALIBRATE_AFTER, total_steps) if every is None else None
        self._last = (start_step, 0.0)  # (step, training seconds) at the previous line

    def print(self, text: str) -> None:
        """One line on rank 0's stderr (and so in ``logs/rank0.log``)."""
        if self.ctx.is_main:
            print(f"[paratrain] {text}", file=sys.stderr, flush=True)

    def due(self, step: int) -> bool:
        """Whether step ``step`` prints a progress line. The same answer on every rank."""
        if step == self.total or step == self.calibrate_at:
            return True
        return self.every is not None and (step - self.start) % self.every == 0

    def calibrate(self, step: int, train_s: float, timed_steps: int) -> None:
        """At ``calibrate_at`` on every rank: adopt rank 0's seconds per step (collective) and print the
        estimated duration of the run."""
        per_step = torch.tensor([train_s / max(1, timed_steps)], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.distributed and self.ctx.world_size > 1:
            dist.broadcast(per_step, src=0)
        seconds = float(per_step.item())
        self.every = max(1, round(TARGET_S / seconds)) if seconds > 0 else 1
        left = self.total - step
        if left > 0:
            self.print(f"first steps timed: {seconds:.3g} s/step, about {duration(seconds * left)} for the "
                       f"{left} step{'s' if left > 1 else ''} left; a line every {self.every} step(s)")  # fmt: skip

    def step_line(self, step: int, loss: float | None, lr: float | None, train_s: float) -> None:
        """The progress line of step ``step`` (rank 0, and only when no progress bar is shown)."""
        prev_step, prev_s = self._last
        self._last = (step, train_s)
        if not self.lines:
            return
        parts = [f"step {step}/{self.total} ({100 * step / max(1, self.total):.0f}%)"]
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if lr is not None:
            parts.append(f"lr {lr:.2e}")
        if step > prev_step and train_s > prev_s:
            rate = (step - prev_step) * self.batch_size / (train_s - prev_s)
            parts.append(f"{rate:,.0f} samples/s")
            if self.tokens_per_sample:
                parts.append(f"{rate * self.tokens_per_sample:,.0f} tokens/s")
        parts.append(f"elapsed {duration(train_s)}")
        done = step - self.start
        if done > 0 and step < self.total:
            parts.append(f"ETA {duration(train_s / done * (self.total - step))}")
        self.print("  ".join(parts))


def header(
    *,
    strategy: str,
    degrees: dict[str, Any],
    world_size: int,
    batch_size: int,
    dp_size: int,
    grad_accum: int,
    start_step: int,
    total_steps: int,
    precision: str,
    dataset: str,
    train_samples: int,
    test_samples: int,
    tokens_per_sample: int | None,
) -> str:
    """The one line of effective settings printed before training."""
    layout = " x ".join(f"{k} {v}" for k, v in degrees.items() if v > 1) or "one rank"
    micro = batch_size // max(1, dp_size * grad_accum)
    epochs = total_steps * batch_size / max(1, train_samples)
    steps = f"{total_steps} steps ({epochs:.3g} epochs)"
    if start_step:
        steps += f", resuming at step {start_step}"
    unit = f" sequences of {tokens_per_sample} tokens" if tokens_per_sample else " samples"
    return (
        f"{strategy} ({layout}) on {world_size} process(es); global batch {batch_size} = micro-batch {micro} x "
        f"{dp_size} data-parallel x {grad_accum} accumulation; {steps}; {precision}; {dataset}: "
        f"{train_samples:,} train / {test_samples:,} test{unit}"
    )


def progress_bar(ctx: Context, enabled: bool | None, total: int, initial: int) -> Any:
    """Rank 0's tqdm bar on stderr (``train.progress``; default: when stderr is a terminal), else ``None``."""
    if not ctx.is_main:
        return None
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
