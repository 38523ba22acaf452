"""The few collectives the checkpoint manager's save and load share: rank 0's answer on every rank, every
rank's problems on every rank, and the parameter names any rank holds. World size 1 runs no collective."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paratrain.runtime import Context


def broadcast_object(obj: Any, ctx: Context) -> Any:
    """Rank 0's ``obj`` on every rank (JSON-able objects only)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def agree(local: list[str], ctx: Context) -> list[str]:
    """Every rank's problems, on every rank, without repeats (one all-gather; world size 1: ``local``)."""
    if not ctx.distributed:
        return local
    gathered: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(gathered, local)
    merged: list[str] = []
    for problems in gathered:
        merged.extend(p for p in problems or [] if p not in merged)
    return merged


def all_names(shapes: dict[str, torch.Size], ctx: Context) -> set[str]:
    """Parameter names held by any rank: a pipeline stage holds only its own layers, so a tensor of
    another stage in the checkpoint is expected, not "unexpected". Collective when distributed."""
    if not (ctx.distributed and dist.is_initialized() and dist.get_world_size() > 1):
        return set(shapes)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(shapes))
    return {name for names in gathered for name in names}
