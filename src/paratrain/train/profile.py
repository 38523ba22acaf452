"""``--profile START:END``: ``torch.profiler`` over optimizer steps START..END on every rank.

The profiler follows a wait / warm-up / active schedule over the run's own step numbers (1-based, as in
the logs): it records nothing until step START - 1, warms up during that step (the profiler's start-up
cost stays out of the trace), records steps START..END, then exports one Chrome/Perfetto trace per rank
to ``RUN_DIR/profile/rank{r}.json`` and stops. The trace's ``ProfilerStep#N`` spans carry the same N.

At the end of the run (:meth:`StepProfiler.finish`, called on every rank), each rank summarises its own
trace (:func:`paratrain.train.profile_summary.summarize_rank`); one ``gather_object`` over the default
group brings the summaries to rank 0, which prints the per-rank table to stderr and writes
``RUN_DIR/profile/summary.json``. That is the profiler's only collective, outside the profiled steps.

CPU activity is always recorded; CUDA activity (kernels, memcpy) too when the run is on a GPU.
Reference: https://pytorch.org/docs/stable/profiler.html
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from paratrain.runtime import Context
from paratrain.train.profile_summary import format_table, summarize_rank, summarize_ranks


def parse_steps(spec: str) -> tuple[int, int]:
    """``"5:8"`` -> ``(5, 8)``; the config has validated the text (``TrainConfig.__post_init__``)."""
    start, end = spec.split(":")
    return int(start), int(end)


class StepProfiler:
    """The profiler of one rank. A no-op when ``spec`` is ``None``.

    The trainer calls :meth:`begin` once before its loop (with the step it resumes from), :meth:`after_step`
    after every optimizer step, and :meth:`finish` on every rank after the loop.
    """

    def __init__(self, spec: str | None, ctx: Context, run_dir: str | Path, log: logging.Logger) -> None:
        self.ctx = ctx
        self.log = log
        self.enabled = spec is not None
        self.start, self.end = parse_steps(spec) if spec is not None else (0, 0)
        self.dir = Path(run_dir) / "profile"
        self.trace_path = self.dir / f"rank{ctx.rank}.json"
        self._prof: Any = None
        self._first = 0
        self._last_done = 0
        self._exported = False

    # ---- the schedule ------------------------------------------------------------------------------------
    def _action(self, step: int) -> Any:
        """What the profiler does during optimizer step ``step`` (1-based): wait, warm up, record, save."""
        from torch.profiler import ProfilerAction

        start = max(self.start, self._first)
        warmup = 1 if start - 1 >= self._first else 0  # the step before START, when this run executes it
        if step < start - warmup or step > self.end:
            return ProfilerAction.NONE
        if step < start:
            return ProfilerAction.WARMUP
        return ProfilerAction.RECORD_AND_SAVE if step == self.end else ProfilerAction.RECORD

    def begin(self, resumed_step: int, total_steps: int) -> None:
        """Start the profiler before the loop; ``resumed_step`` is the last step already done (0: fresh)."""
        if not self.enabled:
            return
        self._first = resumed_step + 1
        self._last_done = resumed_step
        if self.end < self._first or self.start > total_steps:
            if self.ctx.is_main:
                self.log.warning("--profile %d:%d: this run executes steps %d..%d only; nothing is profiled",
                                 self.start, self.end, self._first, total_steps)  # fmt: skip
            self.enabled = False
            return
        self.end = min(self.end, total_steps)
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

        # Kineto prints a line at every start and stop of the profiler: silence it (4 shows its messages)
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        activities = [ProfilerActivity.CPU]
        if self.ctx.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.dir.mkdir(parents=True, exist_ok=True)
        # every thread: paratrain's own all-reduce (`dp --comm-algorithm ring`) runs on a thread of its own
        config = _ExperimentalConfig(profile_all_threads=True)
        self._prof = profile(activities=activities, schedule=self._action, on_trace_ready=self._export,
                             experimental_config=config)  # fmt: skip
        # Number the profiler's steps as the run does: the step about to run is ``_first`` (``step_num``
        # and ``current_action`` are the profiler's public state, set before ``start()`` reads them).
        self._prof.step_num = self._first
        self._prof.current_action = self._action(self._first)
        self._prof.start()

    def after_step(self, step: int) -> None:
        """Optimizer step ``step`` is done: move the schedule on (exports the trace after step END)."""
        if self._prof is not None:
            self._last_done = step
            self._prof.step()
            if step >= self.end:
                self._stop()

    def _export(self, prof: Any) -> None:
        prof.export_chrome_trace(str(self.trace_path))
        self._exported = True

    def _stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()  # a run that ended inside the window: exports what was recorded
            self._prof = None

    # ---- the summary -------------------------------------------------------------------------------------
    def finish(self, strategy: str | None = None) -> dict[str, Any] | None:
        """Collective over the default group: summarise each rank's trace; rank 0 prints the table, writes
        ``profile/summary.json`` and returns it (``None`` elsewhere, and when nothing was profiled)."""
        if not self.enabled:
            return None
        self._stop()
        first, last = max(self.start, self._first), min(self.end, self._last_done)
        mine: dict[str, Any] = {"rank": self.ctx.rank, "steps": 0, "trace": None}
        if self._exported and self.trace_path.is_file() and last >= first:
            with open(self.trace_path) as f:
                trace = json.load(f)
            mine = {"rank": self.ctx.rank, **summarize_rank(trace, self.ctx.world_size, (first, last)),
                    "trace": str(self.trace_path)}  # fmt: skip
        ranks: list[Any] = [mine]
        if self.ctx.distributed and self.ctx.world_size > 1:
            ranks = [None] * self.ctx.world_size if self.ctx.is_main else []
            dist.gather_object(mine, ranks if self.ctx.is_main else None, dst=0)
        if not self.ctx.is_main:
            return None
        summary = summarize_ranks(ranks)
        done = [r for r in ranks if r.get("steps")]
        summary = {
            "profiled_steps": [first, last] if done else [],
            "requested_steps": [self.start, self.end],
            "world_size": self.ctx.world_size,
            "strategy": strategy,
            "device": self.ctx.device.type,
            "timeline": done[0]["timeline"] if done else None,
            "unit": "milliseconds per step",
            **summary,
        }
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if not done:
            self.log.warning("--profile %d:%d: the run ended before step %d; no trace was written",
                             self.start, self.end, first)  # fmt: skip
        else:
            print(format_table(summary), file=sys.stderr)
            traces = f"{self.dir}/rank{{0..{self.ctx.world_size - 1}}}.json"
            print(f"traces: {traces} (open them in https://ui.perfetto.dev); this table: "
                  f"{self.dir / 'summary.json'}", file=sys.stderr, flush=True)  # fmt: skip
        return summary
