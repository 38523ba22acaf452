"""A user's own dataset: ``--data pkg.module:factory``.

The factory is called with the keyword arguments it accepts among ``seed`` (``train.seed``), ``seq_len``,
``test_fraction`` and ``path`` (``data.*``), and returns an object (or a dict) with:

- ``train`` and ``test``: each a pair ``(inputs, targets)`` of tensors with one sample per row, a
  ``torch.utils.data.TensorDataset`` of two tensors, or a :class:`~paratrain.data.TensorData`;
- ``task`` (optional, default ``classification``): ``classification`` (integer targets, cross-entropy,
  accuracy), ``regression`` (float targets of shape ``[n, k]``, mean squared error) or ``lm`` (token ids
  ``[n, seq_len]`` in and the next tokens out);
- ``num_outputs`` (optional): classes, regression targets or vocabulary size; by default the largest
  class/token id + 1, or the targets' width;
- ``transform`` (optional): ``transform(inputs, generator) -> inputs``, train-time augmentation.

A :class:`~paratrain.data.Splits` is accepted as it is. Every rank calls the factory, so it must return the
same data on every rank (seed any randomness with ``seed``).
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.config import DataConfig
from paratrain.errors import ConfigError
from paratrain.spec.factory import call_accepting, load_object

TASKS = ("classification", "regression", "lm")


def _field(obj: Any, name: str, default: Any = None) -> Any:
    return obj.get(name, default) if isinstance(obj, dict) else getattr(obj, name, default)


def _tensors(split: Any, path: str, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(split, "tensors"):  # torch.utils.data.TensorDataset
        split = split.tensors
    elif hasattr(split, "x") and hasattr(split, "y"):
        split = (split.x, split.y)
    if not (
        isinstance(split, (tuple, list))
        and len(split) == 2
        and all(isinstance(t, torch.Tensor) for t in split)
    ):
        raise ConfigError(f"--data {path}: {which} must be (inputs, targets) tensors, a TensorDataset of two "
                          f"tensors or a TensorData; got {type(split).__name__}.")  # fmt: skip
    x, y = split
    if len(x) != len(y) or len(x) == 0:
        raise ConfigError(f"--data {path}: {which} has {len(x)} inputs and {len(y)} targets; give as many "
                          "targets as inputs, at least one.")  # fmt: skip
    return x, y


def build_user_dataset(path: str, cfg: DataConfig, seed: int = 0) -> Any:
    """Call the factory ``path`` names and check what it returns against the protocol (module docstring)."""
    from paratrain.data.registry import Splits, TensorData

    factory = load_object(path, "--data")
    out = call_accepting(
        factory, f"--data {path}", seed=seed, seq_len=cfg.seq_len, test_fraction=cfg.test_fraction, path=None
    )
    if isinstance(out, Splits):
        return out
    if _field(out, "train") is None or _field(out, "test") is None:
        raise ConfigError(f"--data {path} returned {type(out).__name__} without train and test splits; return "
                          "an object or dict with train=(inputs, targets) and test=(inputs, targets).")  # fmt: skip
    task = _field(out, "task", "classification")
    if task not in TASKS:
        raise ConfigError(f"--data {path}: task {task!r} is not one of {', '.join(TASKS)}.")
    (x, y), (tx, ty) = (
        _tensors(_field(out, "train"), path, "train"),
        _tensors(_field(out, "test"), path, "test"),
    )
    if x.shape[1:] != tx.shape[1:]:
        raise ConfigError(f"--data {path}: train inputs are {tuple(x.shape[1:])} per sample, test inputs "
                          f"{tuple(tx.shape[1:])}; they must match.")  # fmt: skip
    if task in ("classification", "lm") and (y.is_floating_point() or ty.is_floating_point()):
        raise ConfigError(f"--data {path}: {task} targets must be integer class ids, got {y.dtype}.")
    num_outputs = _field(out, "num_outputs")
    if num_outputs is None:
        if task == "regression":
            num_outputs = int(y.shape[1]) if y.ndim > 1 else 1
        else:
            top = max(int(y.max()), int(ty.max()))
            num_outputs = max(top, int(x.max()) if task == "lm" else 0) + 1
    input_shape = tuple(int(d) for d in x.shape[1:])
    return Splits(
        TensorData(x, y, _field(out, "transform")), TensorData(tx, ty), task, input_shape, int(num_outputs)
    )
