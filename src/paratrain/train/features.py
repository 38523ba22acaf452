"""Model transforms every data-parallel strategy gets, applied by the worker *before* wrapping:
SyncBatchNorm (chosen automatically for small per-rank batches) and activation checkpointing.

SyncBatchNorm (Ioffe & Szegedy 2015 normalise over a batch; Peng et al., "MegDet", CVPR 2018,
https://arxiv.org/abs/1711.07240, normalise over the *global* batch across devices): torch's
``nn.SyncBatchNorm`` only runs on GPU, so :class:`SyncBatchNorm` subclasses it and, off the GPU, computes
the same thing with one autograd-aware all-reduce per layer (see :func:`_sync_batch_norm`).

Activation checkpointing (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016,
https://arxiv.org/abs/1604.06174; https://pytorch.org/docs/stable/checkpoint.html): each of the model's
``blocks`` keeps only its input in forward and recomputes its activations in backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.config import ConfigError, RunConfig

SMALL_BATCH = 16
"""Below this many samples per rank and forward, BatchNorm statistics are too noisy: sync by default."""


# ---- SyncBatchNorm ---------------------------------------------------------------------------------------
class SyncBatchNorm(nn.SyncBatchNorm):
    """``nn.SyncBatchNorm`` that also runs on CPU (Gloo); on GPU it *is* torch's fused implementation."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type != "cpu" or not self.training:
            return super().forward(input)  # GPU kernels; or eval, which never communicates
        group = self.process_group or (dist.group.WORLD if dist.is_initialized() else None)
        if group is None or dist.get_world_size(group) == 1:
            return _BatchNorm.forward(self, input)  # world size 1: plain BatchNorm, no communication
        self._check_input_dim(input)
        return _sync_batch_norm(self, input, group)


def _sync_batch_norm(bn: SyncBatchNorm, x: torch.Tensor, group: Any) -> torch.Tensor:
    """Normalise with the mean and variance of the *global* batch.

    Communication: one blocking all-reduce (sum) of ``[sum x, sum x^2, count]`` per channel in forward, and
    its autograd backward, one all-reduce of the gradients of those sums, in backward (what torch's CUDA
    kernel does with ``sum_dy`` and ``sum_dy_xmu``). Statistics are accumulated in float32.
    """
    c = x.shape[1]
    dims = [0, *range(2, x.dim())]
    xf = x.float()
    count = torch.full((1,), x.numel() / c, dtype=torch.float32, device=x.device)
    # The public autograd-aware all-reduce warns that it is deprecated in favour of the private
    # torch.distributed._functional_collectives; it still works, and its backward is the all-reduce we want.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        stats = dist_fn.all_reduce(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]), group=group)
    n = stats[2 * c]
    mean = stats[:c] / n
    var = (stats[c : 2 * c] / n - mean * mean).clamp_min(0.0)
    if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
        with torch.no_grad():
            assert bn.num_batches_tracked is not None
            bn.num_batches_tracked.add_(1)
            f = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.mul_(1 - f).add_(mean.detach().to(bn.running_mean.dtype), alpha=f)
            unbiased = var.detach() * (n / (n - 1).clamp_min(1.0))
            bn.running_var.mul_(1 - f).add_(unbiased.to(bn.running_var.dtype), alpha=f)
    shape = [1, c] + [1] * (x.dim() - 2)
    y = (xf - mean.view(shape)) * torch.rsqrt(var.view(shape) + bn.eps)
    if bn.affine:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    return y.to(x.dtype)


def count_batchnorm(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if isinstance(m, _BatchNorm))


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Replace every ``BatchNorm*d`` with :class:`SyncBatchNorm`, keeping the same parameter and buffer tensors
    (so an optimizer built before the conversion still points at them)."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)  # fmt: skip
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        return out
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module


def choose_sync_batchnorm(
    requested: bool | None, num_batchnorm: int, micro_batch: int, dp_size: int
) -> tuple[bool, str]:
    """Decide whether to convert BatchNorm to SyncBatchNorm, and say why (the caller logs it)."""
    if num_batchnorm == 0:
        if requested:
            return (
                False,
                "--sync-batchnorm was requested but the model has no BatchNorm layer: nothing to sync",
            )
        return False, "off (the model has no BatchNorm)"
    if requested is False:
        return False, f"off (disabled by --no-sync-batchnorm; per-rank batch {micro_batch})"
    if dp_size == 1:
        return False, "off (one data-parallel rank: BatchNorm already sees the whole batch)"
    if requested:
        return True, f"on (requested; {num_batchnorm} BatchNorm layers over {dp_size} ranks)"
    if micro_batch < SMALL_BATCH:
        return True, (
            f"on (automatic: per-rank batch {micro_batch} < {SMALL_BATCH}; statistics of the global batch of "
            f"{micro_batch * dp_size} instead; --no-sync-batchnorm turns it off)"
        )
    return (
        False,
        f"off (automatic: per-rank batch {micro_batch} >= {SMALL_BATCH}; --sync-batchnorm forces it)",
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
    if cfg.train.activation_checkpointing:
        blocks = getattr(model, "blocks", None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise ConfigError(
                f"--activation-checkpointing recomputes the model's `blocks`, and model {cfg.model.name!r} "
                "has none. Drop the flag or use a model with blocks (cnn, resnet, ...)."
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
    """Wrap each of ``model.blocks`` in non-reentrant activation checkpointing; returns how many were wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
        raise ConfigError(
            f"--activation-checkpointing needs a model with a `blocks` ModuleList; {type(model).__name__} has none."
        )
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                       context_fn=functools.partial(_contexts, block))  # fmt: skip
    return len(blocks)


# ---- one entry point for the worker -------------------------------------------------------------------------
def apply_model_features(
    model: nn.Module, cfg: RunConfig, dp_size: int, log: logging.Logger | None = None
) -> nn.Module:
    """SyncBatchNorm choice and activation checkpointing, before the model is moved and wrapped."""
    t = cfg.train
    micro = t.batch_size // (dp_size * t.grad_accum)
    on, why = choose_sync_batchnorm(t.sync_batchnorm, count_batchnorm(model), micro, dp_size)
    if log is not None:
        log.info("sync-batchnorm: %s", why)
    if on:
        model = convert_sync_batchnorm(model)
    if t.activation_checkpointing:
        n = apply_activation_checkpointing(model)
        if log is not None:
            log.info("activation checkpointing: %d blocks recompute their activations in backward", n)
    return model
