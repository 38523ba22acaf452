"""Datasets and the resumable distributed batch sampler.

Every dataset is held in memory as tensors (:class:`TensorData`): the workloads paratrain ships are small,
and indexing a tensor is far cheaper than a DataLoader worker pool on a two-core machine. A dataset is
registered under a name with :func:`register_dataset`; ``DataConfig.name`` picks it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from paratrain.config import ConfigError, DataConfig
from paratrain.data.sampler import DistributedBatchSampler

__all__ = [
    "DistributedBatchSampler",
    "Splits",
    "TensorData",
    "available_datasets",
    "build_dataset",
    "register_dataset",
]

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


@dataclass
class TensorData:
    """Inputs ``x`` and targets ``y`` as tensors; ``transform`` augments a train batch of ``x``."""

    x: torch.Tensor
    y: torch.Tensor
    transform: Transform | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])


@dataclass
class Splits:
    train: TensorData
    test: TensorData
    task: str
    """``classification`` (cross-entropy, accuracy) or ``regression`` (mean squared error)."""
    input_shape: tuple[int, ...]
    num_outputs: int


DatasetBuilder = Callable[[DataConfig], Splits]
_REGISTRY: dict[str, DatasetBuilder] = {}


def register_dataset(name: str) -> Callable[[DatasetBuilder], DatasetBuilder]:
    def deco(fn: DatasetBuilder) -> DatasetBuilder:
        _REGISTRY[name] = fn
        return fn

    return deco


def available_datasets() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def build_dataset(cfg: DataConfig) -> Splits:
    _load_builtin()
    if cfg.name not in _REGISTRY:
        raise ConfigError(f"unknown dataset {cfg.name!r}. Choose one of: {', '.join(available_datasets())}.")
    return _REGISTRY[cfg.name](cfg)


def split_indices(n: int, test_fraction: float, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic shuffled train/test split of ``range(n)`` (same on every rank and every run)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    n_test = max(1, round(n * test_fraction))
    return perm[n_test:], perm[:n_test]


def _load_builtin() -> None:
    from paratrain.data import cifar, digits, mnist, synthetic  # noqa: F401  (registers)
