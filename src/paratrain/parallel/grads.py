"""Gradients that may be DTensors (tensor parallel, FSDP2, both): layout, replica averaging, global norm.

Used by the model-parallel strategies (:mod:`.tensor`, :mod:`.pipeline`) after their backward passes:

- :func:`align_grads`: a gradient can come out of autograd in another layout than its parameter (a
  replicated norm weight used on a sequence shard gets a ``Partial`` sum); one packed all-reduce per group
  of axes fixes all of them;
- :func:`all_reduce_replicas`: data-parallel replicas average their gradients, bucketed, all launched
  before the first is waited for;
- :func:`clip_grad_norm`: the global L2 norm with one all-reduce per set of sharded axes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    fn = getattr(t, "to_local", None)
    return fn() if callable(fn) else t


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the full value of ``t`` (a DTensor loss or output is gathered)."""
    fn = getattr(t, "full_tensor", None)
    return fn() if callable(fn) else t


def clip_grad_norm(
    params: Iterable[nn.Parameter], max_norm: float, device: torch.device, extra_group: Any = None
) -> torch.Tensor:
    """Clip to the global L2 norm of gradients that may be DTensors sharded over several mesh axes.

    Each gradient contributes the squares of its local shard; squares of gradients sharded over the same
    set of axes are summed locally and all-reduced once over each of those axes (a replicated axis needs
    nothing: every rank holds the same values). ``extra_group`` adds one more all-reduce of the total, over
    ranks that hold disjoint parameters (the pipeline stages). The coefficient ``max_norm / (norm + 1e-6)``,
    clamped to 1, is the one of ``torch.nn.utils.clip_grad_norm_``.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    sums: dict[tuple[Any, ...], torch.Tensor] = {}
    for g in grads:
        key: tuple[Any, ...] = ()
        if isinstance(g, DTensor):
            mesh = g.device_mesh
            # a Partial gradient would need its values summed before squaring; the plans never leave one
            assert not any(p.is_partial() for p in g.placements), (
                "partial gradient: reduce it before clipping"
            )
            # sharded: Shard, and FSDP2's _StridedShard over a TP shard (which is not a Shard subclass)
            key = tuple(
                mesh.get_group(i)
                for i, p in enumerate(g.placements)
                if not (p.is_replicate() or p.is_partial())
            )
        sq = to_local(g).detach().float().pow(2).sum().to(device)
        sums[key] = sums[key] + sq if key in sums else sq
    total = torch.zeros((), dtype=torch.float32, device=device)
    for groups, sq in sums.items():  # the same keys in the same order on every rank of each group
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(sq, group=group)
        total += sq
    if extra_group is not None and dist.get_world_size(extra_group) > 1:
        dist.all_reduce(total, group=extra_group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            local = to_local(g)
            local.mul_(coef.to(local.device, local.dtype))
    return norm


def align_grads(params: Iterable[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements.

    Autograd can leave a gradient in another layout than its parameter: a replicated norm weight used on a
    sequence shard gets a ``Partial(sum)`` gradient (each tp rank holds the sum over its part of the
    sequence), the vocabulary-sharded embedding a replicated one. Partial gradients are summed with one
    all-reduce (of all of them, packed) per group of mesh axes; a replicated gradient of a sharded
    parameter keeps this rank's slice (no communication). Optimizers then see gradients shaped like their
    parameters, and :func:`clip_grad_norm` counts each element once.
    """
    from torch.distributed.tensor import DTensor, Replicate

    partial: dict[tuple[Any, ...], list[nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or not isinstance(p, DTensor) or g.placements == p.placements:
            continue
        if any(pl.is_partial() for pl in g.placements):
            key = tuple(g.device_mesh.get_group(i) for i, pl in enumerate(g.placements) if pl.is_partial())
            partial.setdefault(key, []).append(p)
        else:
            p.grad = g.redistribute(g.device_mesh, p.placements)
    for groups, ps in partial.items():  # same keys, same order on every rank of a group
        locals_ = [to_local(p.grad) for p in ps]  # type: ignore[arg-type]
        flat = torch.cat([t.reshape(-1) for t in locals_])
        for group in groups:
            dist.all_reduce(flat, group=group)
        offset = 0
        for p, t in zip(ps, locals_, strict=True):
            g = p.grad
            assert isinstance(g, DTensor)
            reduced = flat[offset : offset + t.numel()].view_as(t)
            offset += t.numel()
            placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            full = DTensor.from_local(reduced, g.device_mesh, placements, shape=g.shape, stride=g.stride())
            wanted = p.placements  # type: ignore[attr-defined]  # a DTensor parameter
            p.grad = full if tuple(placements) == tuple(wanted) else full.redistribute(g.device_mesh, wanted)


def all_reduce_replicas(params: Iterable[nn.Parameter], group: Any, bucket_bytes: int) -> None:
    """Average gradients over ``group`` (data-parallel replicas): their local shards packed into buckets of
    about ``bucket_bytes``, one all-reduce per bucket, all launched before the first is waited for."""
    n = dist.get_world_size(group)
    if n == 1:
        return
    grads = [to_local(p.grad) for p in params if p.grad is not None]
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for g in grads:
        if buckets[-1] and size + g.numel() * g.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.numel() * g.element_size()
    flats, works = [], []
    for bucket in buckets:
        if not bucket:
            continue
        flat = torch.cat([g.reshape(-1) for g in bucket])
        flats.append((bucket, flat))
        works.append(dist.all_reduce(flat, group=group, async_op=True))
    for (bucket, flat), work in zip(flats, works, strict=True):
        assert work is not None
        work.wait()
        flat /= n
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def accumulation_sync(model: nn.Module, shard_accumulated: bool) -> contextlib.AbstractContextManager[None]:
    """An FSDP2 strategy's context for an accumulation micro-step: no gradient sync (gradients accumulate
    unsharded), or, with ``strategy.shard_accumulated_grads``, the usual reduce-scatter (FSDP2 accumulates into
    the sharded gradients)."""
    return contextlib.nullcontext() if shard_accumulated else no_gradient_sync(model)


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """FSDP2: no reduce-scatter (nor HSDP's all-reduce) on this micro-step; gradients accumulate unsharded,
    and every unit follows the root's setting. A model without FSDP2 is left as it is."""
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is None:
        yield
        return
    set_sync(False)
    try:
        yield
    finally:
        set_sync(True)
