"""Synthetic data made on the spot: Gaussian-cluster classification and noisy linear regression."""

from __future__ import annotations

import torch

from paratrain.config import DataConfig
from paratrain.data.registry import Splits, TensorData, register_dataset, split_indices


@register_dataset("synthetic-classification")
def classification(cfg: DataConfig) -> Splits:
    g = torch.Generator().manual_seed(4321)
    centers = torch.randn(cfg.num_classes, cfg.num_features, generator=g) * 2.0
    y = torch.randint(0, cfg.num_classes, (cfg.num_samples,), generator=g)
    x = centers[y] + torch.randn(cfg.num_samples, cfg.num_features, generator=g)
    tr, te = split_indices(cfg.num_samples, cfg.test_fraction)
    return Splits(
        TensorData(x[tr], y[tr]),
        TensorData(x[te], y[te]),
        "classification",
        (cfg.num_features,),
        cfg.num_classes,
    )


@register_dataset("synthetic-regression")
def regression(cfg: DataConfig) -> Splits:
    g = torch.Generator().manual_seed(8765)
    w = torch.randn(cfg.num_features, 1, generator=g)
    x = torch.randn(cfg.num_samples, cfg.num_features, generator=g)
    y = x @ w + 0.1 * torch.randn(cfg.num_samples, 1, generator=g)
    tr, te = split_indices(cfg.num_samples, cfg.test_fraction)
    return Splits(TensorData(x[tr], y[tr]), TensorData(x[te], y[te]), "regression", (cfg.num_features,), 1)
