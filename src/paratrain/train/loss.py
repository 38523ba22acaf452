"""The training loss of each task, and the label that is not predicted."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IGNORE_LABEL = -100
"""A label that is not predicted (a prompt token of ``--data jsonl``; ``cross_entropy``'s ``ignore_index``)."""


def loss_function(task: str) -> Any:
    """The training loss of a task: cross-entropy (classification; next-token for ``lm``) or MSE."""

    def classification(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float(), y)

    def lm(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())

    def regression(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), y)

    return {"classification": classification, "lm": lm, "regression": regression}[task]
