"""``ddp``: PyTorch's native DistributedDataParallel, configured the way its docs ask.

Communication schedule (done by DDP's C++ reducer): at construction, rank 0's parameters and buffers are
broadcast. During backward, gradients are packed into ``bucket_cap_mb`` buckets in roughly reverse
registration order; each bucket's all-reduce (sum, then divided by world size) is launched asynchronously
as soon as its last gradient is ready, overlapping the rest of backward; ``backward()`` returns after all
buckets finished. With ``forward_sync_buffers=True`` (the 2.13 name of ``broadcast_buffers``) buffers (BatchNorm running stats) are re-broadcast from
rank 0 before every forward. Inside ``no_sync()`` gradients only accumulate locally.

Reference: https://pytorch.org/docs/stable/notes/ddp.html
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.parallel import Strategy, register_strategy


@register_strategy("ddp")
class NativeDDP(Strategy):
    description = "torch DistributedDataParallel: replicated model, bucketed async gradient all-reduce"

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        # The model must live on its device *before* wrapping: DDP registers hooks on these parameters and
        # broadcasts them from rank 0; moving afterwards would leave DDP pointing at stale tensors.
        model = model.to(self.ctx.device)
        if not self.ctx.distributed:
            return model, optimizer  # world size 1: nothing to synchronise
        device_ids = [self.ctx.local_rank] if self.ctx.device.type == "cuda" else None
        ddp = DDP(
            model,
            device_ids=device_ids,
            forward_sync_buffers=True,  # re-broadcast buffers (BatchNorm stats) from rank 0 each forward
            bucket_cap_mb=self.config.bucket_cap_mb,
            gradient_as_bucket_view=self.config.gradient_as_bucket_view,
            static_graph=self.config.static_graph,
            find_unused_parameters=self.config.find_unused_parameters,
        )
        return ddp, optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if isinstance(model, DDP):
            return model.no_sync()
        return contextlib.nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model


def warn_unused(model: nn.Module) -> list[str]:
    """Names of trainable parameters that received no gradient in the last backward (and a warning)."""
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        warnings.warn(
            f"{len(unused)} parameter(s) got no gradient: {unused[:5]}. DDP waits for every parameter's "
            "gradient; enable --set strategy.find_unused_parameters=true, or remove the unused modules.",
            stacklevel=2,
        )
    return unused
