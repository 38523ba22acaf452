"""What a dataset builder returns, and the registry of dataset names (:func:`register_dataset`).

A dataset module imports this registry; the registry imports no dataset (:mod:`paratrain.data` loads them),
so the entries never import back the package that collects them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paratrain.config import DataConfig
from paratrain.data.batch import Batch

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


@dataclass
class TensorData:
    """Inputs ``x`` and targets ``y`` as tensors; ``transform`` augments a train batch of ``x``."""

    x: torch.Tensor
    y: torch.Tensor
    transform: Transform | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def batch(self, indices: torch.Tensor) -> Batch:
        return Batch(self.x[indices], self.y[indices])


@dataclass
class Splits:
    train: TensorData
    test: TensorData
    task: str
    """``classification`` (cross-entropy, accuracy), ``regression`` (mean squared error) or ``lm``
    (next-token cross-entropy over ``[batch, seq_len]`` token ids; perplexity)."""
    input_shape: tuple[int, ...]
    num_outputs: int


DatasetBuilder = Callable[[DataConfig], Splits]
REGISTRY: dict[str, DatasetBuilder] = {}


def register_dataset(name: str) -> Callable[[DatasetBuilder], DatasetBuilder]:
    def deco(fn: DatasetBuilder) -> DatasetBuilder:
        REGISTRY[name] = fn
        return fn

    return deco


def split_indices(n: int, test_fraction: float, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic shuffled train/test split of ``range(n)`` (same on every rank and every run)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    n_test = max(1, round(n * test_fraction))
    return perm[n_test:], perm[:n_test]
