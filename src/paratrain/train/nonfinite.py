"""Non-finite training stops (or skips the step), on every rank together, before the optimizer step.

A NaN or an infinity in the loss or in any gradient would otherwise be applied by the optimizer and
spread into every parameter: the run would "finish" with NaN losses and exit 0. After backward and before
``optimizer.step()``, every rank checks its loss and its local gradients (its shard, under ZeRO/FSDP/TP;
its 1/N share of the gradients that data parallel has made the same on every rank),
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

    permanent = "non-finite values (a restart resumes from the same checkpoint and diverges again)"


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


def _finite(grads: list[torch.Tensor]) -> bool:
    """Whether every element of ``grads`` is finite: one sum per tensor (a sum is NaN or infinite iff an
    element is, or iff it overflows, which is as fatal for the update), read once; 16-bit tensors are
    summed in float32 so that a large sum of finite values does not overflow."""
    sums = []
    for g in grads:
        if g.numel() == 0:
            continue
        if g.is_complex():
            g = torch.view_as_real(g)
        sums.append(g.sum(dtype=torch.float32) if g.dtype in (torch.float16, torch.bfloat16) else g.sum())
    return not sums or bool(torch.isfinite(torch.stack([x.double() for x in sums])).all())


def _share(t: torch.Tensor, share: tuple[int, int] | None) -> torch.Tensor:
    if share is None:
        return t
    index, count = share
    return t.reshape(-1).tensor_split(count)[index]


def check_finite(
    model: nn.Module, loss: torch.Tensor, ctx: Context, check_grads: bool = True,
    share: tuple[int, int] | None = None,
) -> list[int]:  # fmt: skip
    """The ranks whose loss or gradients are not finite (empty: all finite). Collective on every rank.

    ``share=(index, count)``: the gradients are the same on ``count`` ranks (data parallel after its
    all-reduce), and this rank reads only part ``index`` of each (``tensor_split`` of the flat gradient);
    the all-reduce of the flags covers the rest, so the verdict is the same at 1/count of the reads.
    """
    bad = not bool(torch.isfinite(loss).all())
    if not bad and check_grads:
        grads = [_share(_local(p.grad), share) for p in model.parameters() if p.grad is not None]
        bad = not _finite(grads)
    if not ctx.distributed or ctx.world_size == 1:
        return [ctx.rank] if bad else []
    flags = torch.zeros(ctx.world_size, dtype=torch.int32, device=ctx.device)
    flags[ctx.rank] = int(bad)
    dist.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def describe(step: int, ranks: list[int], ctx: Context, model: nn.Module, loss: torch.Tensor) -> str:
    """The error message: step, ranks, and the first non-finite gradient this rank holds, if any."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    text = f"non-finite loss or gradient at step {step} on {who}"
    if ctx.rank in ranks and not bool(torch.isfinite(loss).all()):
        text += f" (this rank's loss is {float(loss)})"
    # every rank looks (only on this error path): under ddp/dp a rank checked only its share of gradients
    # that every rank holds, so a rank not named above may still find the parameter
    name = first_nonfinite_gradient(model)
    if name is not None:
        text += f"; first non-finite parameter gradient: {name}"
    return (
        text + ". The run stopped before the optimizer step. Lower --lr, set --set optimizer.grad_clip=1.0, "
        "or --set train.on_nonfinite=skip to skip such steps."
    )
