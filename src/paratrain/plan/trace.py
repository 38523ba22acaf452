"""Activations and FLOPs of a model that is not a transformer, measured by running it on the meta device.

Meta tensors have shapes and dtypes but no storage, so a forward of a model built on ``torch.device("meta")``
costs microseconds and allocates nothing. During that forward, a :func:`torch.autograd.graph.saved_tensors_hooks`
pack hook sees every tensor autograd keeps for backward: their bytes (each tensor once; parameters and
views of parameters excluded) are the activations. A forward pre-hook on each block of ``model.blocks``
attributes what is saved inside it, and records the block's input (what activation checkpointing keeps in
its place). ``torch.utils.flop_counter.FlopCounterMode`` counts the forward and backward FLOPs of the same
pass. A batch of 2 is traced and divided by 2 (BatchNorm needs more than one sample).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paratrain.plan.profile import ActivationProfile

_BATCH = 2


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, list | tuple):
        return sum(_nbytes(v) for v in x)
    return 0


def profile_module(
    model: nn.Module, blocks: list[nn.Module], input_shape: tuple[int, ...]
) -> ActivationProfile:
    """Per-sample saved bytes (all, per block), block inputs and FLOPs of ``model`` (on the meta device)."""
    from torch.utils.flop_counter import FlopCounterMode

    params = {id(p) for p in model.parameters()}
    keep: list[torch.Tensor] = []  # holding the tensors keeps their ids unique while we count
    seen: set[int] = set()
    current: list[int] = []
    saved_in = [0] * len(blocks)
    inputs = [0] * len(blocks)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = t._base if t._base is not None else t
        if id(t) in seen or id(base) in params or id(t) in params:
            return t
        seen.add(id(t))
        keep.append(t)
        total += _nbytes(t)
        if current:
            saved_in[current[-1]] += _nbytes(t)
        return t

    handles = []
    for i, block in enumerate(blocks):

        def pre(_m: nn.Module, args: Any, i: int = i) -> None:
            current.append(i)
            inputs[i] += _nbytes(args)

        def post(_m: nn.Module, _args: Any, _out: Any) -> None:
            current.pop()

        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    x = torch.empty((_BATCH, *input_shape), device="meta")
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(x)
                if out.dim() == 2:
                    target = torch.zeros(_BATCH, dtype=torch.long, device="meta")
                    loss = nn.functional.cross_entropy(out.float(), target)
                else:
                    loss = out.float().pow(2).mean()
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return ActivationProfile(
        saved=total / _BATCH,
        blocks_saved=tuple(s / _BATCH for s in saved_in),
        blocks_input=tuple(s / _BATCH for s in inputs),
        flops=float(counter.get_total_flops()) / _BATCH,
        batch=math.prod(input_shape) * 4 + (8 if out.dim() == 2 else 0),
    )
