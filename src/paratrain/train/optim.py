"""The optimizer and learning-rate schedule of a run, built from ``cfg.optimizer``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paratrain.config import RunConfig
from paratrain.errors import ConfigError


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


_FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""The optimizers paratrain builds, each with a fused kernel on CPU and CUDA in the pinned torch."""


def _stepping(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that runs the update: zero1/zero2's ShardedOptimizer steps an inner one."""
    inner = getattr(optimizer, "optim", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def fused_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why torch's fused kernel cannot update ``optimizer``'s parameters (None: it can)."""
    from torch.distributed.tensor import DTensor

    optimizer = _stepping(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not isinstance(optimizer, _FUSABLE):
        return f"{type(optimizer).__name__} has no fused kernel"
    if any(p.device.type not in ("cpu", "cuda") or not p.is_floating_point() for p in params):
        return "a parameter is not a floating-point tensor on the CPU or a CUDA device"
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) > 1:  # one kernel call takes either plain tensors or DTensors, not both
        return "the strategy leaves some parameters as plain tensors and shards others as DTensors"
    if kinds == {True} and isinstance(optimizer, torch.optim.SGD):
        return "DTensor has no sharding rule for torch's fused SGD"
    return None


def _steps_on_device(optimizer: torch.optim.Optimizer) -> None:
    """State loaded from a run that updated one tensor at a time keeps its ``step`` counters on the CPU."""
    for p, st in optimizer.state.items():
        step = st.get("step") if isinstance(st, dict) else None
        if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
            st["step"] = step.to(device=p.device, dtype=torch.float32)


def set_implementation(optimizer: Any, choice: str) -> str:
    """Apply ``optimizer.implementation`` to every param group of ``optimizer`` (built by
    :func:`build_optimizer` and already bound to the wrapped model's parameters); returns what runs:
    ``fused``, ``foreach`` or ``for-loop``. Applied again after a checkpoint is loaded, whose param groups
    carry the options of the run that saved it. ``fused`` where it cannot run is refused, naming why."""
    why = fused_refusal(optimizer) if choice in ("auto", "fused") else None
    if choice == "fused" and why is not None:
        raise ConfigError(
            f"optimizer.implementation=fused cannot run here: {why}. Use --set optimizer.implementation=auto "
            "(fused where it can run) or for-loop."
        )
    stepping = _stepping(optimizer)
    groups = optimizer.param_groups + (stepping.param_groups if stepping is not optimizer else [])
    fallback = choice == "auto" and why is not None
    chosen = choice if choice != "auto" else ("fused" if why is None else "")
    for g in groups:  # zero1/zero2 copy the outer groups' options into the inner ones before every step
        g["fused"] = chosen == "fused"
        g["foreach"] = None if fallback else chosen == "foreach"  # None: torch's default for the device
    if chosen == "fused":  # the kernel reads each step counter on its parameter's device, as float32
        _steps_on_device(stepping)
    if fallback:  # torch's default: foreach for CUDA tensors, one tensor at a time on the CPU
        on_cuda = any(p.device.type == "cuda" for g in groups for p in g["params"])
        chosen = "foreach" if on_cuda else "for-loop"
    return chosen


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig, total_steps: int) -> Any:
    o = cfg.optimizer

    def factor(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "cosine":
            span = max(1, total_steps - o.warmup_steps)
            progress = min(1.0, (step - o.warmup_steps) / span)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
