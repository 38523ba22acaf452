"""The optimizer and learning-rate schedule of a run, built from ``cfg.optimizer``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from paratrain.config import RunConfig


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.AdamW(params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)


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
