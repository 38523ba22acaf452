"""scikit-learn's handwritten digits: 1,797 images of 8x8 pixels, 10 classes, shipped with the package."""

from __future__ import annotations

import torch

from paratrain.config import DataConfig
from paratrain.data import Splits, TensorData, register_dataset, split_indices


def _shift_augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random translation by up to one pixel (zero padding): a small, label-preserving augmentation."""
    n = x.shape[0]
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1))
    dx = torch.randint(0, 3, (n,), generator=g)
    dy = torch.randint(0, 3, (n,), generator=g)
    h, w = x.shape[-2:]
    rows = (dy[:, None] + torch.arange(h)[None, :])[:, :, None].expand(n, h, w)
    cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, :].expand(n, h, w)
    batch = torch.arange(n)[:, None, None].expand(n, h, w)
    return padded[batch, 0, rows, cols].unsqueeze(1)


@register_dataset("digits")
def digits(cfg: DataConfig) -> Splits:
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    x = (x - 0.3) / 0.4  # roughly zero mean, unit variance
    y = torch.tensor(raw.target, dtype=torch.long)
    tr, te = split_indices(len(y), cfg.test_fraction)
    return Splits(
        train=TensorData(x[tr], y[tr], _shift_augment if cfg.augment else None),
        test=TensorData(x[te], y[te]),
        task="classification",
        input_shape=(1, 8, 8),
        num_outputs=10,
    )
