"""``--tracker tensorboard`` (or ``--tensorboard``): TensorBoard event files in ``RUN_DIR/tensorboard/``.

The scalars are those of every tracker (:mod:`paratrain.train.trackers`: ``train/loss``, ``train/lr``,
``throughput/samples_per_s``, ``memory/peak_bytes``, ``eval/loss``, ``moe/...``), each at the optimizer step
it belongs to; the run's config goes to TensorBoard's HParams plugin (the ``HPARAMS`` tab), with
``train/loss`` and ``eval/loss`` as its metrics.

Written with ``torch.utils.tensorboard.SummaryWriter``, which needs the optional ``tensorboard`` package
(``pip install 'paratrain[tensorboard]'``). Read them with ``tensorboard --logdir RUN_DIR/tensorboard``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardWriter:
    """One ``SummaryWriter`` on rank 0: the hyperparameters once, then scalars by step."""

    def __init__(self, log_dir: str | Path, params: dict[str, Any] | None = None, step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.writer: Any = SummaryWriter(log_dir=str(self.log_dir))
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
