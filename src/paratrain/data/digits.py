"""scikit-learn's handwritten digits: 1,797 images of 8x8 pixels, 10 classes, shipped with the package."""

from __future__ import annotations

import gzip
import importlib.util
import os

import numpy as np
import torch

from paratrain.config import DataConfig
from paratrain.data.registry import Splits, TensorData, register_dataset, split_indices


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


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images (N, 8, 8) float64, targets (N,) int): the CSV that ``sklearn.datasets.load_digits`` parses,
    read directly. Importing scikit-learn costs about 2 s of CPU, paid by the launcher and by every rank of
    every run on digits; locating the package does not import it. Falls back to scikit-learn's loader if
    the file is not where its package keeps it."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(root, "datasets", "data", "digits.csv.gz")
        if os.path.isfile(path):
            with gzip.open(path, mode="rt", encoding="utf-8") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    raw = load_digits()
    return raw.images, raw.target


@register_dataset("digits")
def digits(cfg: DataConfig) -> Splits:
    images, target = _load_digits()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    x = (x - 0.3) / 0.4  # roughly zero mean, unit variance
    y = torch.tensor(target, dtype=torch.long)
    tr, te = split_indices(len(y), cfg.test_fraction)
    return Splits(
        train=TensorData(x[tr], y[tr], _shift_augment if cfg.augment else None),
        test=TensorData(x[te], y[te]),
        task="classification",
        input_shape=(1, 8, 8),
        num_outputs=10,
    )
