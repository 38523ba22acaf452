"""One batch of training data, typed: ``inputs`` and ``targets``, whatever the task.

Classification and regression batches are ``(x, y)`` with one target per sample; a language-model batch
is ``(input_ids, labels)``, two ``[batch, seq_len]`` integer tensors where ``labels`` is ``input_ids``
shifted by one token. The trainer and the strategies only ever see a :class:`Batch`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor
    """Model inputs: features, images, or token ids ``[batch, seq_len]``."""
    targets: torch.Tensor
    """What the loss compares the output with: class ids, values, or next-token ids ``[batch, seq_len]``."""

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in a token batch (samples x sequence length); samples otherwise."""
        return (
            int(self.targets.numel())
            if self.targets.dim() >= 2 and not self.targets.is_floating_point()
            else len(self)
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            self.inputs.to(device, non_blocking=non_blocking),
            self.targets.to(device, non_blocking=non_blocking),
        )

    def split(self, parts: int) -> list[Batch]:
        """``parts`` equal micro-batches along the sample dimension (the caller checked divisibility)."""
        size = len(self) // parts
        return [Batch(x, y) for x, y in zip(self.inputs.split(size), self.targets.split(size), strict=True)]
