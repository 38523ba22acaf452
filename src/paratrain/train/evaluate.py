"""Evaluation on the test split, split across the data-parallel ranks, with exact global totals."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.data import Splits
from paratrain.parallel import Strategy
from paratrain.runtime import Context
from paratrain.train.console import ConsoleLog
from paratrain.train.loss import IGNORE_LABEL
from paratrain.train.precision import Precision

EVAL_BATCHES, LM_EVAL_BATCHES = 20, 4
"""Global batches an evaluation covers without ``--eval-batches``: tensor data, language models."""


def eval_size(data: Splits, t: TrainConfig) -> int:
    """Test samples each evaluation covers: the first ``eval_batches`` global batches (all with 0)."""
    n, cap = len(data.test), t.eval_batches
    if cap is None:
        cap = LM_EVAL_BATCHES if data.task == "lm" else EVAL_BATCHES
    return min(n, cap * t.batch_size) if cap else n


@torch.no_grad()
def evaluate(
    model: nn.Module,
    strategy: Strategy,
    data: Splits,
    ctx: Context,
    precision: Precision,
    n: int,
    *,
    step: int,
    batch_size: int = 512,
    console: ConsoleLog | None = None,
) -> tuple[float | None, float]:
    """Accuracy (classification) and mean loss on the first ``n`` samples of the test split, split across
    data-parallel ranks.

    Every rank runs the same number of forward passes (sharded models communicate in forward), padding
    with weight-0 samples; correct/count/loss sums are all-reduced, so the totals are exact. For a
    language model the loss is the mean over every predicted token, and there is no accuracy.
    """
    model.eval()
    test, task = data.test, data.task
    r, w = strategy.dp_rank, strategy.dp_size
    e0 = time.perf_counter()
    if console is not None:
        console.print(f"step {step}: evaluating on {n:,} of {len(test):,} test samples (--eval-batches)")
    mine = torch.arange(r, n, w)
    per_rank = -(-n // w)
    pad = per_rank - len(mine)
    weights = torch.cat([torch.ones(len(mine)), torch.zeros(pad)])
    mine = torch.cat([mine, torch.zeros(pad, dtype=torch.long)])
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # correct, count, loss sum
    for start in range(0, per_rank, batch_size):
        sl = slice(start, start + batch_size)
        batch = test.batch(mine[sl]).to(ctx.device)
        wt = weights[sl].to(ctx.device, torch.float64)
        with precision.autocast():
            out = strategy.evaluate_forward(model, batch.inputs)
        if out is None:  # a pipeline stage without the head: the last stage counts
            continue
        _accumulate(sums, task, out.float(), batch.targets, wt)
    if ctx.distributed and ctx.world_size > 1:
        # every rank joins: a pipeline's non-last stages contribute zeros, replicas their shares
        dist.all_reduce(sums, group=strategy.eval_group())
    model.train()
    acc = float(sums[0] / sums[1]) if task == "classification" else None
    loss = float(sums[2] / sums[1])
    if console is not None:
        shown = f"eval loss {loss:.4f}" + (f", accuracy {acc:.2%}" if acc is not None else "")
        console.print(f"step {step}: {shown} ({time.perf_counter() - e0:.1f} s)")
    return acc, loss


def _accumulate(sums: torch.Tensor, task: str, out: torch.Tensor, y: torch.Tensor, wt: torch.Tensor) -> None:
    """Add one batch's weighted correct count, sample (or token) count and loss sum to ``sums``."""
    count = wt
    if task == "regression":
        per = ((out - y) ** 2).mean(dim=1).double()
    elif task == "lm":  # every sample counts its predicted tokens (seq_len unless labels are masked)
        tok = nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        per = tok.view(y.shape).double().sum(dim=1)
        count = wt * (y != IGNORE_LABEL).sum(dim=1).double()
    else:
        per = nn.functional.cross_entropy(out, y, reduction="none").double()
        sums[0] += ((out.argmax(1) == y).double() * wt).sum()
    sums[1] += count.sum()
    sums[2] += (per * wt).sum()
