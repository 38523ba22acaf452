"""Layers whose forward communicates: :class:`SyncBatchNorm`, which runs on CPU (Gloo) too.

SyncBatchNorm (Ioffe & Szegedy 2015 normalise over a batch; Peng et al., "MegDet", CVPR 2018,
https://arxiv.org/abs/1711.07240, normalise over the *global* batch across devices): torch's
``nn.SyncBatchNorm`` only runs on GPU, so :class:`SyncBatchNorm` subclasses it and, off the GPU, computes
the same thing with one autograd-aware all-reduce per layer (see :func:`_sync_batch_norm`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

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
