"""The training loop: accumulation, precision, clipping, evaluation, metrics, checkpoints, the summary.

One optimizer step, on every rank:

    indices = sampler.next_batch()                      # this rank's B/W samples of global batch t
    for k in range(K):                                  # K = grad_accum micro-batches of B/(W*K)
        with strategy.no_sync(model) unless k == K-1:   # only the last micro-step communicates
            loss_k = loss_fn(model(x_k), y_k)
            backward(loss_k / K)                        # /K: K micro-batches sum to one batch's mean
    clip (global norm) -> optimizer.step() -> scheduler.step()

Per-step losses stay on the device and are averaged over ranks in one all-reduce at logging time, not
every step, so logging adds no synchronisation to the hot loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint import CheckpointManager
from paratrain.checkpoint.lifecycle import RunLifecycle
from paratrain.config import RunConfig
from paratrain.data import DistributedBatchSampler, Splits
from paratrain.diagnose.faults import peer_guard
from paratrain.parallel import Strategy, canonical_name, model_state_bytes
from paratrain.runtime import Context, get_logger
from paratrain.train.metrics import MetricsWriter
from paratrain.train.precision import Precision


@dataclass
class TrainResult:
    """What a run produced; ``summary()`` is the ``--json`` contract of DESIGN.md."""

    strategy: str
    world_size: int
    num_params: int
    steps: int
    losses: list[float]
    final_loss: float | None
    eval_accuracy: float | None
    eval_loss: float | None
    samples_per_s: float | None
    param_sha256: str | None
    param_norm: float | None
    model_state_bytes_per_rank: int | None
    restarts: int
    resumed_from_step: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


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


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full, unsharded parameters in registration order, on rank 0 (``None`` on other ranks)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    order = [canonical_name(n) for n, _ in model.named_parameters()]
    out: dict[str, torch.Tensor] = {}
    for name in order:
        t: Any = sd[name]
        out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def param_digest(params: dict[str, torch.Tensor]) -> tuple[str, float]:
    """sha256 of the float32 bytes of every parameter in name order, and the float64 L2 norm."""
    h = hashlib.sha256()
    sq = 0.0
    for t in params.values():
        f = t.detach().to(torch.float32).contiguous().cpu()
        h.update(f.numpy().tobytes())
        sq += float(f.double().pow(2).sum())
    return h.hexdigest(), math.sqrt(sq)


class Trainer:
    """Runs one training job on this rank. Construct it on every rank with the prepared objects."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: Context,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        data: Splits,
        num_params: int,
        run_dir: str | Path,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.data = data
        self.num_params = num_params
        self.run_dir = Path(run_dir)
        self.log = get_logger(ctx)
        t = cfg.train
        self.micro_batch = t.batch_size // (strategy.dp_size * t.grad_accum)
        self.sampler = DistributedBatchSampler(
            len(data.train), t.batch_size, strategy.dp_rank, strategy.dp_size, seed=t.seed, shuffle=True
        )
        self.total_steps = (
            t.steps if t.steps is not None else (t.epochs or 1) * self.sampler.batches_per_epoch
        )
        self.scheduler = build_scheduler(optimizer, cfg, self.total_steps)
        self.precision = Precision(t.precision, ctx.device)
        self.step = 0
        self.resumed_from: int | None = None
        self._gen = torch.Generator().manual_seed(t.seed * 1000 + strategy.dp_rank)
        ckpt_dir = cfg.checkpoint.dir or str(self.run_dir / "checkpoints")
        self.ckpt = CheckpointManager(ckpt_dir, ctx, cfg.checkpoint.keep_last, cfg.checkpoint.async_save)
        self.losses: list[float] = []
        """Global mean loss per step, flushed from ``_pending_losses`` at log/save time (one all-reduce)."""
        self._pending_losses: list[torch.Tensor] = []
        self.lifecycle = RunLifecycle(self)
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", enabled=ctx.is_main)

    # ---- helpers --------------------------------------------------------------------------------------
    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.data.task == "regression":
            return nn.functional.mse_loss(out.float(), y)
        return nn.functional.cross_entropy(out.float(), y)

    def _global_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks (every rank holds the same number of samples)."""
        if self.ctx.distributed and self.strategy.dp_size > 1:
            values = values.clone()
            dist.all_reduce(values, group=self.strategy.dp_group)
            values /= self.strategy.dp_size
        return values

    def flush_losses(self) -> None:
        """Average the pending per-step losses over ranks (one all-reduce) and append them to ``losses``."""
        if self._pending_losses:
            self.losses.extend(self._global_mean(torch.stack(self._pending_losses).float()).tolist())
            self._pending_losses.clear()

    # ---- resume ---------------------------------------------------------------------------------------
    def maybe_resume(self) -> None:
        """Load the checkpoint ``checkpoint.resume`` selects (see :mod:`paratrain.checkpoint.lifecycle`)."""
        self.lifecycle.resume()

    # ---- the loop -------------------------------------------------------------------------------------
    def train_step(self) -> torch.Tensor:
        t = self.cfg.train
        model = self.model
        model.train()
        idx = self.sampler.next_batch()
        x, y = self.data.train.x[idx], self.data.train.y[idx]
        if self.data.train.transform is not None:
            x = self.data.train.transform(x, self._gen)
        x = x.to(self.ctx.device, non_blocking=True)
        y = y.to(self.ctx.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.ctx.device)
        for k, (xm, ym) in enumerate(zip(x.split(self.micro_batch), y.split(self.micro_batch), strict=True)):
            last = k == t.grad_accum - 1
            sync = contextlib.nullcontext() if last else self.strategy.no_sync(model)
            with sync:
                with self.precision.autocast():
                    loss = self._loss(model(xm), ym)
                self.precision.backward(loss / t.grad_accum)
            total += loss.detach()
        if self.cfg.optimizer.grad_clip is not None:
            self.precision.unscale(self.optimizer)
            self.strategy.clip_grad_norm(model, self.cfg.optimizer.grad_clip)
        self.precision.step(self.optimizer)
        self.scheduler.step()
        return total / t.grad_accum

    @torch.no_grad()
    def evaluate(self, batch_size: int = 512) -> tuple[float | None, float]:
        """Accuracy (classification) and mean loss on the test split, split across data-parallel ranks.

        Every rank runs the same number of forward passes (sharded models communicate in forward), padding
        with weight-0 samples; correct/total/loss sums are all-reduced, so the totals are exact.
        """
        model = self.model
        model.eval()
        test = self.data.test
        n, r, w = len(test), self.strategy.dp_rank, self.strategy.dp_size
        mine = torch.arange(r, n, w)
        per_rank = -(-n // w)
        pad = per_rank - len(mine)
        weights = torch.cat([torch.ones(len(mine)), torch.zeros(pad)])
        mine = torch.cat([mine, torch.zeros(pad, dtype=torch.long)])
        sums = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # correct, count, loss sum
        for start in range(0, per_rank, batch_size):
            sl = slice(start, start + batch_size)
            x = test.x[mine[sl]].to(self.ctx.device)
            y = test.y[mine[sl]].to(self.ctx.device)
            wt = weights[sl].to(self.ctx.device, torch.float64)
            with self.precision.autocast():
                out = model(x).float()
            if self.data.task == "regression":
                per = ((out - y) ** 2).mean(dim=1).double()
                sums[0] += 0.0
            else:
                per = nn.functional.cross_entropy(out, y, reduction="none").double()
                sums[0] += ((out.argmax(1) == y).double() * wt).sum()
            sums[1] += wt.sum()
            sums[2] += (per * wt).sum()
        if self.ctx.distributed and w > 1:
            dist.all_reduce(sums, group=self.strategy.dp_group)
        model.train()
        acc = float(sums[0] / sums[1]) if self.data.task == "classification" else None
        return acc, float(sums[2] / sums[1])

    def fit(self) -> TrainResult:
        t = self.cfg.train
        self.maybe_resume()
        start_step = self.step
        logged = self.losses
        bar = _progress(self.ctx, t.progress, self.total_steps, start_step)
        self.ctx.synchronize()
        t0 = time.perf_counter()
        eval_time = 0.0
        self.lifecycle.install_signal_handlers()
        # peer_guard: a collective that fails because a peer died or hung is re-raised naming that rank.
        with peer_guard(self.ctx) as peers:
            while self.step < self.total_steps:
                self._pending_losses.append(self.train_step())
                self.step += 1
                if peers is not None:
                    peers.step = self.step
                if bar is not None:
                    bar.update(1)
                if self.step % t.log_every == 0 or self.step == self.total_steps:
                    self.flush_losses()
                    if bar is not None:
                        bar.set_postfix(loss=f"{logged[-1]:.4f}")
                    self.metrics.write(
                        {"step": self.step, "loss": logged[-1], "lr": self.scheduler.get_last_lr()[0]}
                    )
                if t.eval_every and self.step % t.eval_every == 0 and self.step < self.total_steps:
                    e0 = time.perf_counter()
                    acc_i, eloss_i = self.evaluate()
                    eval_time += time.perf_counter() - e0
                    self.metrics.write({"step": self.step, "eval_accuracy": acc_i, "eval_loss": eloss_i})
                e0 = time.perf_counter()
                # async-save poll, fault injection, coordinated stop on a signal, periodic save
                stop = self.lifecycle.after_step()
                eval_time += time.perf_counter() - e0
                if stop:
                    break
        self.lifecycle.restore_signal_handlers()
        self.ctx.synchronize()
        train_time = time.perf_counter() - t0 - eval_time
        if bar is not None:
            bar.close()
        steps_run = self.step - start_step
        samples_per_s = steps_run * t.batch_size / train_time if steps_run and train_time > 0 else None
        self.flush_losses()
        acc, eloss = None, None
        if not self.lifecycle.stopped_by:  # a signal-stopped run skips evaluation to exit quickly
            acc, eloss = self.evaluate()
        self.metrics.write({"step": self.step, "eval_accuracy": acc, "eval_loss": eloss, "final": True})
        ckpt_path = self.lifecycle.finish(steps_run)  # final save, and wait for any async save in flight
        state_bytes = torch.tensor([model_state_bytes(self.model, self.optimizer)], dtype=torch.int64)
        if self.ctx.distributed:
            dist.all_reduce(state_bytes, op=dist.ReduceOp.MAX)
        params = full_parameters(self.model)
        sha, norm = param_digest(params) if params is not None else (None, None)
        self.metrics.close()
        return TrainResult(
            strategy=self.strategy.name,
            world_size=self.ctx.world_size,
            num_params=self.num_params,
            steps=self.step,
            losses=logged,
            final_loss=logged[-1] if logged else None,
            eval_accuracy=acc,
            eval_loss=eloss,
            samples_per_s=samples_per_s,
            param_sha256=sha,
            param_norm=norm,
            model_state_bytes_per_rank=int(state_bytes.item()),
            restarts=self.ctx.restart_count,
            resumed_from_step=self.resumed_from,
            extra={
                "global_batch_size": t.batch_size,
                "grad_accum": t.grad_accum,
                "precision": t.precision,
                "train_time_s": train_time,
                "run_dir": str(self.run_dir),
                "checkpoint": ckpt_path,
                "checkpoint_blocked_s": list(self.ckpt.blocked_s),
                "stopped_by_signal": self.lifecycle.stopped_by,
                "device": self.ctx.device.type,
                "backend": self.ctx.backend,
            },
        )


def _progress(ctx: Context, enabled: bool | None, total: int, initial: int) -> Any:
    if not ctx.is_main:
        return None
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary))
