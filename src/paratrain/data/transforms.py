"""Batched image augmentation written with plain tensor ops (no torchvision).

A transform is a callable ``(x, generator) -> x`` over a whole batch ``x`` of shape ``(N, C, H, W)``; the
Trainer calls it on each rank's share of a global batch with a per-rank ``torch.Generator``, so runs are
reproducible. Every transform draws its randomness from that generator only.

The classic CIFAR recipe (He et al., "Deep Residual Learning for Image Recognition", 2016, section 4.2):
pad 4 pixels, take a random 32x32 crop, flip horizontally with probability 1/2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Transform = Callable[[torch.Tensor, torch.Generator], torch.Tensor]


def random_crop(padding: int = 4) -> Transform:
    """Zero-pad by ``padding`` pixels on every side and cut a random crop of the original size per image."""
    if padding < 0:
        raise ValueError(f"random_crop: padding must be >= 0, got {padding}")

    def apply(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        if padding == 0:
            return x
        n, c, h, w = x.shape
        padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
        dy = torch.randint(0, 2 * padding + 1, (n,), generator=g)
        dx = torch.randint(0, 2 * padding + 1, (n,), generator=g)
        # One gather instead of a Python loop over images: index (n, c, rows, cols) of the padded batch.
        rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None].expand(n, c, h, w)
        cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :].expand(n, c, h, w)
        batch = torch.arange(n)[:, None, None, None].expand(n, c, h, w)
        chan = torch.arange(c)[None, :, None, None].expand(n, c, h, w)
        return padded[batch, chan, rows, cols]

    return apply


def random_hflip(p: float = 0.5) -> Transform:
    """Mirror each image left-right with probability ``p``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"random_hflip: p must be in [0, 1], got {p}")

    def apply(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        flip = torch.rand(x.shape[0], generator=g) < p
        return torch.where(flip[:, None, None, None], x.flip(-1), x)

    return apply


def normalize(x: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """Per-channel ``(x - mean) / std`` of a ``(N, C, H, W)`` float tensor (done once, at load time)."""
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m) / s


def compose(*transforms: Transform) -> Transform:
    """Apply ``transforms`` left to right, all drawing from the same generator."""

    def apply(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        for t in transforms:
            x = t(x, g)
        return x

    return apply


def crop_flip(padding: int = 4, flip: bool = True) -> Transform:
    """Pad-and-crop, then (when ``flip``) a horizontal flip: the standard CIFAR augmentation."""
    return compose(random_crop(padding), random_hflip()) if flip else random_crop(padding)
