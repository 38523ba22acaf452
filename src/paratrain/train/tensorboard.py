"""``--tracker tensorboard`` (or ``--tensorboard``): TensorBoard event files in ``RUN_DIR/tensorboard/``.

The scalars are those of every tracker (:mod:`paratrain.train.trackers`: ``train/loss``, ``train/lr``,
``throughput/samples_per_s``, ``memory/peak_bytes``, ``eval/loss``, ``moe/...``), each at the optimizer step
it belongs to; the run's config goes to TensorBoard's HParams plugin (the ``HPARAMS`` tab), with
``train/loss`` and ``eval/loss`` as its metrics.

Written with ``torch.utils.tensorboard.SummaryWriter``, which needs the optional ``tensorboard`` package
(``pip install 'paratrain[tensorboard]'``). Read them with ``tensorboard --logdir RUN_DIR/tensorboard``.

A resumed run (``step`` > 0) opens its writer with ``purge_step=step + 1``: TensorBoard hides what an earlier
launch logged after the checkpoint it resumed from (a crash after the last save), so each step is drawn once.
A new run in a used directory (``--resume never``, ``step`` 0) moves the old event files into
``tensorboard/previous-<time they were last written>/``, which TensorBoard shows as a run of its own, instead
of drawing both runs' steps 1, 2, ... on one curve.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class TensorBoardWriter:
    """One ``SummaryWriter`` on rank 0: the hyperparameters once, then scalars by step."""

    def __init__(self, log_dir: str | Path, params: dict[str, Any] | None = None, step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        if step == 0:
            _set_aside(self.log_dir)
        self.writer: Any = SummaryWriter(log_dir=str(self.log_dir), purge_step=step + 1 if step > 0 else None)
        if params:
            from torch.utils.tensorboard.summary import hparams

            # in this run's own event file (SummaryWriter.add_hparams would open a sub-run of its own)
            metrics = {"train/loss": 0.0, "eval/loss": 0.0}
            values = {k: "None" if v is None else v for k, v in params.items()}  # None is no hparam type
            for summary in hparams(values, metrics):
                # at the step the run starts from: TensorBoard drops the events after an earlier step
                # it meets (a restart), so a resumed run's hyperparameters at step 0 would hide its past
                self.writer._get_file_writer().add_summary(summary, global_step=step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a run that dies later keeps what was logged

    def close(self) -> None:
        self.writer.close()


def _set_aside(log_dir: Path) -> None:
    """Move an earlier run's event files (of a run directory used again from step 0) into a subdirectory."""
    old = sorted(log_dir.glob("events.out.tfevents.*")) if log_dir.is_dir() else []
    if not old:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(max(p.stat().st_mtime for p in old)))
    dest = log_dir / f"previous-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = log_dir / f"previous-{stamp}-{n}"
    dest.mkdir()
    for p in old:
        os.replace(p, dest / p.name)
