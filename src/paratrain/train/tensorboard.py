"""``--tensorboard``: the run's scalars as TensorBoard event files in ``RUN_DIR/tensorboard/`` (rank 0).

Tags, each at the optimizer step it belongs to:

- ``train/loss`` (global mean over data-parallel ranks), ``train/lr``, ``train/grad_norm`` (only with
  ``--set optimizer.grad_clip=...``: the clip computes the global norm; nothing is computed for logging);
- ``throughput/samples_per_s``, ``throughput/tokens_per_s`` (language models), over each logging interval;
- ``memory/model_state_bytes`` (rank 0's parameters + gradients + optimizer state, at rest) and
  ``memory/peak_bytes`` (rank 0's live bytes during the measured step, once it is measured);
- ``eval/loss``, ``eval/accuracy`` (classification), ``eval/perplexity`` (language models);
- mixture-of-experts models: ``moe/overload``, ``moe/dropped_fraction``, ``moe/aux_loss`` and
  ``moe/layer{i}/expert{e}`` (tokens routed to each expert in the step, summed over ranks).

Written with ``torch.utils.tensorboard.SummaryWriter``, which needs the optional ``tensorboard`` package
(``pip install 'paratrain[tensorboard]'``). Read them with ``tensorboard --logdir RUN_DIR/tensorboard``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

_STEP_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "samples_per_s": "throughput/samples_per_s",
    "tokens_per_s": "throughput/tokens_per_s",
    "model_state_bytes": "memory/model_state_bytes",
    "peak_bytes": "memory/peak_bytes",
}
_EVAL_TAGS = {"eval_loss": "eval/loss", "eval_accuracy": "eval/accuracy"}


class TensorBoardObserver:
    """Writes the records of :class:`~paratrain.train.observe.RunObservers` as scalars (rank 0 only)."""

    def __init__(self, log_dir: str | Path, perplexity: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self.perplexity = perplexity
        """A language model: also write ``eval/perplexity`` = exp(eval loss)."""
        self.writer: Any = SummaryWriter(log_dir=str(self.log_dir))

    def _write(self, step: int, record: dict[str, Any], tags: dict[str, str]) -> None:
        for key, tag in tags.items():
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # a run that dies later keeps what was logged

    def on_step_end(self, step: int, record: dict[str, Any]) -> None:
        moe = record.get("moe")
        if isinstance(moe, dict):  # flattened into scalars: moe/overload, moe/layer0/expert3, ...
            flat = {f"moe/{k}": moe.get(k) for k in ("overload", "dropped_fraction", "aux_loss")}
            for i, counts in enumerate(moe.get("tokens_per_expert") or []):
                flat.update({f"moe/layer{i}/expert{e}": c for e, c in enumerate(counts)})
            self._write(step, flat, {k: k for k in flat})
        self._write(step, record, _STEP_TAGS)

    def on_eval(self, step: int, record: dict[str, Any]) -> None:
        tags = dict(_EVAL_TAGS)
        loss = record.get("eval_loss")
        if self.perplexity and isinstance(loss, float):
            record = {**record, "eval_perplexity": math.exp(min(loss, 700.0))}
            tags["eval_perplexity"] = "eval/perplexity"
        self._write(step, record, tags)

    def close(self) -> None:
        self.writer.close()
