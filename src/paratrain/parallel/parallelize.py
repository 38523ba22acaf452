"""``parallelize(model, strategy, ...)``: the model transforms of a run, in torchtitan's fixed order.

1. tensor parallel (the strategy's TP plan over the ``tp`` mesh axis), when ``tp > 1``;
2. SyncBatchNorm, chosen automatically for small per-rank batches (a layer swap; it must precede wrapping);
3. activation checkpointing of each block (Chen et al., "Training Deep Nets with Sublinear Memory Cost",
   2016, https://arxiv.org/abs/1604.06174; https://pytorch.org/docs/stable/checkpoint.html): each block
   keeps only its input in forward and recomputes its activations in backward;
4. ``torch.compile`` per block, when asked for (not with tensor parallelism: the launcher refuses it);
5. the data-parallel wrap: FSDP2 or replication (:meth:`Strategy.wrap`), which also rebinds the optimizer.

Wrappers register hooks on the modules and parameters they see at wrap time, so the order matters: each
step sees the modules the previous one produced.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.config import RunConfig
from paratrain.errors import ConfigError
from paratrain.models.spec import model_blocks as spec_model_blocks
from paratrain.parallel.layers import choose_sync_batchnorm, convert_sync_batchnorm, count_batchnorm
from paratrain.parallel.strategy import Strategy


def model_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The repeated blocks of a model, as its spec says (:func:`paratrain.models.spec.model_blocks`):
    ``None`` when it has none."""
    blocks = spec_model_blocks(model)
    return blocks or None


def _replace_blocks(model: nn.Module, fn: Any) -> int:
    for attr in ("blocks", "layers"):
        container = getattr(model, attr, None)
        if isinstance(container, nn.ModuleDict) and len(container) > 0:
            for key in list(container.keys()):
                container[key] = fn(container[key])
            return len(container)
        if isinstance(container, nn.ModuleList) and len(container) > 0:
            for i, block in enumerate(container):
                container[i] = fn(block)
            return len(container)
    raise ConfigError(
        f"--activation-checkpointing needs a model with `blocks` or `layers`; {type(model).__name__} has none."
    )


def preflight_features(cfg: RunConfig, model: nn.Module) -> list[str]:
    """Checks run in the launching process on the (meta-device) model: errors raise :class:`ConfigError`,
    non-fatal problems are returned as warnings for the CLI to print."""
    warnings: list[str] = []
    if cfg.train.sync_batchnorm and count_batchnorm(model) == 0:
        warnings.append(
            f"--sync-batchnorm has no effect: model {cfg.model.name!r} has no BatchNorm layer "
            "(use --model resnet, or --set model.batchnorm=true with --model cnn)."
        )
    if cfg.train.activation_checkpointing and model_blocks(model) is None:
        raise ConfigError(
            f"--activation-checkpointing recomputes the model's blocks, and model {cfg.model.name!r} "
            "has none. Drop the flag or use a model with blocks (cnn, resnet, llama, ...)."
        )
    return warnings


# ---- activation checkpointing ------------------------------------------------------------------------------
class _KeepBatchNormStats:
    """Recompute context: BatchNorm running statistics must be updated once per step, not once per forward,
    so the block's BatchNorm buffers are saved before the recompute and restored after it."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.saved = [
            (b, b.clone())
            for m in self.block.modules()
            if isinstance(m, _BatchNorm)
            for b in (m.running_mean, m.running_var, m.num_batches_tracked)
            if b is not None
        ]

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, s in self.saved:
                b.copy_(s)
        self.saved = []


def _contexts(block: nn.Module) -> tuple[contextlib.AbstractContextManager[None], Any]:
    return contextlib.nullcontext(), _KeepBatchNormStats(block)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap each block in non-reentrant activation checkpointing; returns how many were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    def wrap(block: nn.Module) -> nn.Module:
        return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  context_fn=functools.partial(_contexts, block))  # fmt: skip

    return _replace_blocks(model, wrap)


def apply_compile(model: nn.Module) -> int:
    """``torch.compile`` each block in place (``Module.compile`` keeps parameter names unchanged)."""
    blocks = model_blocks(model)
    targets = blocks if blocks is not None else [model]
    for block in targets:
        block.compile()
    return len(targets)


def parallelize(
    model: nn.Module,
    strategy: Strategy,
    optimizer_factory: Any,
    cfg: RunConfig,
    log: logging.Logger | None = None,
) -> tuple[nn.Module, Any]:
    """Apply the run's transforms in order (module docstring) and build the optimizer; returns both.

    ``optimizer_factory(model)`` is called after the model is on its device (and tensor-parallel sharded),
    before the data-parallel wrap, which rebinds it to sharded parameters where needed.
    """
    t = cfg.train
    model = strategy.apply_tensor_parallel(model.to(strategy.ctx.device))
    micro = t.batch_size // (strategy.dp_size * t.grad_accum)
    on, why = choose_sync_batchnorm(t.sync_batchnorm, count_batchnorm(model), micro, strategy.dp_size)
    if log is not None:
        log.info("sync-batchnorm: %s", why)
    if on:
        model = convert_sync_batchnorm(model, strategy.batchnorm_group())
    if t.activation_checkpointing:
        n = apply_activation_checkpointing(model)
        if log is not None:
            log.info("activation checkpointing: %d blocks recompute their activations in backward", n)
    if t.compile:
        n = apply_compile(model)
        if log is not None:
            log.info("torch.compile: %d module(s) compiled", n)
    optimizer = optimizer_factory(model)
    return strategy.wrap(model, optimizer)
