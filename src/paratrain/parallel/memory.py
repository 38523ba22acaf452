"""Bytes a rank holds for its model state, counted from the tensors it actually has (local shards only)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t  # DTensor -> this rank's shard


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def model_state_bytes(model: nn.Module, optimizer: Any) -> int:
    """Bytes this rank holds for parameters + gradients + optimizer state, counting only local shards.

    Storage shared by several tensors (a gradient that is a view of a DDP bucket) is counted once.
    """
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        t = _local(t)
        if t.device.type == "meta":
            return
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen and t.numel() > 0:
            return
        seen.add(key)
        total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        add(p.grad)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    if inner is not None:
        for state in inner.state.values():
            for t in _tensors(state):
                add(t)
        for (
            group
        ) in inner.param_groups:  # zero2 keeps reduced gradient shards on the inner optimizer's params
            for p in group["params"]:
                add(p.grad)
    return total
