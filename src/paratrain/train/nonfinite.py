"""Non-finite training stops (or skips the step), on every rank together, before the optimizer step.

A NaN or an infinity in the loss or in any gradient would otherwise be applied by the optimizer and
spread into every parameter: the run would "finish" with NaN losses and exit 0. After backward and before
``optimizer.step()``, every rank checks its loss and its local gradients (its shard, under ZeRO/FSDP/TP),
then one all-reduce of a per-rank flag vector tells every rank which ranks saw a non-finite value, so all
ranks take the same decision at the same step, as with the stop agreement. ``--on-nonfinite skip`` skips
the step instead (as a GradScaler does for fp16 overflow), up to ``train.max_nonfinite_skips`` times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.runtime import Context


class NonFiniteError(RuntimeError):
    """Training produced a NaN or an infinity; the message names the step, the rank(s) and the parameter."""


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def first_nonfinite_gradient(model: nn.Module) -> str | None:
    """Name of the first parameter (in registration order) whose local gradient holds a NaN or an inf."""
    from paratrain.parallel import canonical_name

    for name, p in model.named_parameters():
        if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all()):
            return canonical_name(name)
    return None


def check_finite(model: nn.Module, loss: torch.Tensor, ctx: Context, check_grads: bool = True) -> list[int]:
    """The ranks whose loss or gradients are not finite (empty: all finite). Collective on every rank."""
    bad = not bool(torch.isfinite(loss).all())
    if not bad and check_grads:
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        if grads:
            # one fused pass: the sum of squares is NaN/inf iff some element is (or overflows, which is
            # just as fatal for the update)
            norms = (
                torch._foreach_norm([g for g in grads if g.numel()]) if any(g.numel() for g in grads) else []
            )
            bad = bool(norms) and not bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())
    if not ctx.distributed or ctx.world_size == 1:
        return [ctx.rank] if bad else []
    flags = torch.zeros(ctx.world_size, dtype=torch.int32, device=ctx.device)
    flags[ctx.rank] = int(bad)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def describe(step: int, ranks: list[int], ctx: Context, model: nn.Module, loss: torch.Tensor) -> str:
    """The error message: step, ranks, and (on a rank that saw it) the first non-finite gradient."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    text = f"non-finite loss or gradient at step {step} on {who}"
    if ctx.rank in ranks:
        if not bool(torch.isfinite(loss).all()):
            text += f" (this rank's loss is {float(loss)})"
        name = first_nonfinite_gradient(model)
        if name is not None:
            text += f"; first non-finite parameter gradient: {name}"
    return (
        text + ". The run stopped before the optimizer step. Lower --lr, set --set optimizer.grad_clip=1.0, "
        "or --set train.on_nonfinite=skip to skip such steps."
    )
