"""``TrainState``: everything about a run's progress that a checkpoint must carry, in one object.

The trainer advances it; :class:`~paratrain.train.lifecycle.RunLifecycle` saves and restores it. Nothing
else reaches into the trainer's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.checkpoint.state import jsonable
from paratrain.data import DistributedBatchSampler
from paratrain.train.precision import Precision


@dataclass
class TrainState:
    step: int
    """Optimizer steps done."""
    total_steps: int
    """Steps this run trains to."""
    sampler: DistributedBatchSampler
    """Position in the data (epoch, batch), resumable exactly."""
    scheduler: Any
    """The learning-rate scheduler."""
    precision: Precision
    """Autocast and the fp16 GradScaler (its scale is state)."""
    augment: torch.Generator
    """This rank's data-augmentation stream."""
    losses: list[float] = field(default_factory=list)
    """Global mean loss per step, flushed from ``pending`` at log/save time (one all-reduce)."""
    pending: list[torch.Tensor] = field(default_factory=list)
    """Per-step losses still on the device, not yet averaged over ranks."""
    resumed_from: int | None = None
    """The step this run resumed from, or ``None``."""

    def to_json(self) -> dict[str, Any]:
        """The JSON part of a checkpoint's training state (step is added by the checkpoint manager)."""
        scaler = self.precision.scaler
        return {
            "sampler": self.sampler.state_dict(),
            "scheduler": jsonable(self.scheduler.state_dict()),
            "scaler": jsonable(scaler.state_dict()) if scaler is not None else None,
            "losses": list(self.losses),
        }

    def load_json(self, state: dict[str, Any], keep_losses: bool) -> None:
        """Restore from a checkpoint's training state (the inverse of :meth:`to_json`)."""
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None and self.precision.scaler is not None:
            self.precision.scaler.load_state_dict(state["scaler"])
        self.losses[:] = [float(v) for v in state.get("losses", [])] if keep_losses else []
        self.resumed_from = self.step
