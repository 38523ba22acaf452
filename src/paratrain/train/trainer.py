"""The training loop: accumulation, precision, clipping, evaluation, metrics, checkpoints, the summary.

One optimizer step, on every rank:

    batch = data.train.batch(sampler.next_batch())      # this rank's B/W samples of global batch t
    loss = strategy.forward_backward(model, batch, loss_fn, precision, K)
        # default: K = grad_accum micro-batches, no_sync() on all but the last, backward(loss_k / K);
        # a pipeline schedule runs its own interleaving of micro-batches over the stages instead
    clip (global norm) -> optimizer.step() -> scheduler.step()

Per-step losses stay on the device and are averaged over ranks in one all-reduce at logging time, not
every step, so logging adds no synchronisation to the hot loop.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from paratrain.checkpoint import CheckpointManager
from paratrain.config import RunConfig
from paratrain.data import Batch, DistributedBatchSampler, Splits
from paratrain.train.faults import peer_guard
from paratrain.models.moe import after_optimizer_step, moe_layers, pop_aux_loss
from paratrain.parallel import Strategy, canonical_name, model_state_bytes
from paratrain.runtime import Context, get_logger
from paratrain.spec.hardware import gpu_peak_flops
from paratrain.train.console import ConsoleLog, header
from paratrain.train.desync import check_desync
from paratrain.train.lifecycle import RunLifecycle
from paratrain.train.memory import measure_peak
from paratrain.train.metrics import MetricsWriter
from paratrain.train.nonfinite import NonFiniteError, check_finite, describe
from paratrain.train.observe import RunObservers
from paratrain.train.precision import Precision
from paratrain.train.state import TrainState

EVAL_BATCHES, LM_EVAL_BATCHES = 20, 4
"""Global batches an evaluation covers without ``--eval-batches``: tensor data, language models."""


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


IGNORE_LABEL = -100
"""A label that is not predicted (a prompt token of ``--data jsonl``; ``cross_entropy``'s ``ignore_index``)."""


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


def _full_state_dict(model: nn.Module, cpu_offload: bool = False) -> dict[str, Any]:
    """``get_model_state_dict(full_state_dict=True)``: every DTensor gathered to a full tensor (collective).

    An ``fsdp+tp`` parameter is ``(_StridedShard(0), Shard(0))`` on a mesh whose ``dp_shard`` and ``tp`` axes are
    not flattened, so DTensor gathers it with two all-gathers and logs a warning saying so on every rank. This
    runs once per run, for the summary (not a hot path), so that one logger is quietened around it only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
        return dict(get_model_state_dict(model, options=options))
    finally:
        redistribute_log.setLevel(level)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The full, unsharded parameters in registration order, on rank 0 (``None`` on other ranks).

    Collective. A pipeline rank holds only its stages (the model carries the full model's parameter order,
    ``_paratrain_param_order``): every rank gathers its stages' full tensors (over its tensor and data
    axes), and rank 0 collects one copy of each stage with ``gather_object`` and puts them in the full order.
    """
    full_order: list[str] | None = getattr(model, "_paratrain_param_order", None)
    if full_order is not None and dist.is_initialized() and dist.get_world_size() > 1:
        sd = _full_state_dict(model)
        # one copy per stage is enough: only the ranks at tensor/data coordinate 0 send theirs
        send = getattr(model, "_paratrain_pp_sender", True)
        local = {k: v.detach().cpu() for k, v in sd.items() if isinstance(v, torch.Tensor)} if send else {}
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
        dist.gather_object(local, gathered if dist.get_rank() == 0 else None, dst=0)
        if dist.get_rank() != 0:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return {name: merged[name] for name in full_order}
    sd = _full_state_dict(model, cpu_offload=True)
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
        sampler = DistributedBatchSampler(
            len(data.train), t.batch_size, strategy.dp_rank, strategy.dp_size, seed=t.seed, shuffle=True
        )
        total = t.steps if t.steps is not None else (t.epochs or 1) * sampler.batches_per_epoch
        self.state = TrainState(
            step=0,
            total_steps=total,
            sampler=sampler,
            scheduler=build_scheduler(optimizer, cfg, total),
            precision=Precision(t.precision, ctx.device),
            augment=torch.Generator().manual_seed(t.seed * 1000 + strategy.dp_rank),
        )
        ckpt_dir = cfg.checkpoint.dir or str(self.run_dir / "checkpoints")
        self.ckpt = CheckpointManager(
            ckpt_dir,
            ctx,
            cfg.checkpoint.keep_last,
            cfg.checkpoint.async_save,
            writer_factory=checkpoint_writer_factory(ctx.rank),
            # every rank must see the directory, unless the run neither saves nor resumes
            check_shared=bool(
                cfg.checkpoint.every or cfg.checkpoint.save_at_end or cfg.checkpoint.resume != "never"
            ),
        )
        self.lifecycle = RunLifecycle(
            self.state,
            self.ckpt,
            model,
            optimizer,
            cfg,
            ctx,
            {"strategy": strategy.name, "dp_size": strategy.dp_size, "num_params": num_params},
            strategy.dp_rank,
            self.flush_losses,
            self.log,
        )
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", enabled=ctx.is_main)
        # metrics.jsonl, TensorBoard (--tensorboard), the profiler (--profile): train/observe.py
        seq_len = int(data.train.x.shape[1]) if data.task == "lm" else None
        state_bytes = functools.partial(model_state_bytes, model, optimizer)  # at logging steps, rank 0
        self.observers = RunObservers(cfg, ctx, self.run_dir, self.metrics, state_bytes, seq_len)
        self.grad_norm: torch.Tensor | None = None
        """The global gradient norm of the last step, when ``optimizer.grad_clip`` computes it."""
        self.step_lr: float | None = None
        """The learning rate the last optimizer step used (logged as ``lr``; the scheduler has moved on)."""
        self.moe_stats: dict[str, Any] | None = {} if moe_layers(model) else None
        """MoE models: the last step's expert load (:func:`paratrain.models.moe.after_optimizer_step`)."""
        self.nonfinite_skips = 0
        """Steps skipped because of a non-finite loss or gradient (``--set train.on_nonfinite=skip``)."""
        self.masked_lm = data.task == "lm" and bool((data.train.y == IGNORE_LABEL).any())
        """Labels with ignored positions (``jsonl`` prompt/completion): the loss is normalised per step."""
        self.tokens_per_call: torch.Tensor | None = None
        """Masked labels: the global batch's predicted tokens / the loss calls of one step over all ranks."""

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def losses(self) -> list[float]:
        return self.state.losses

    # ---- helpers --------------------------------------------------------------------------------------
    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.tokens_per_call is not None:  # sum over predicted tokens / their share per loss call
            s = nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten(), reduction="sum")
            loss = s / self.tokens_per_call
        else:
            loss = loss_function(self.data.task)(out, y)
        aux = pop_aux_loss(self.model) if self.moe_stats is not None else None  # MoE balance loss
        return loss if aux is None else loss + aux

    def _predicted_tokens_per_call(self, targets: torch.Tensor) -> torch.Tensor:
        """Masked labels: the predicted tokens of the whole global batch (one all-reduce over the data-parallel
        ranks) over the number of loss calls in the step (ranks x accumulation x pipeline micro-batches). Each
        call returns its summed cross-entropy over this; the strategies' mean over calls and ranks is then
        the global batch's mean over predicted tokens, whatever the layout (every call has equal weight)."""
        n = (targets != IGNORE_LABEL).sum().to(torch.float64)
        if self.ctx.distributed and self.strategy.dp_size > 1:
            dist.all_reduce(n, group=self.strategy.dp_group)
        topo = self.strategy.topology
        m = (self.strategy.config.microbatches or topo.pp) if topo.pp > 1 else 1
        calls = self.strategy.dp_size * self.cfg.train.grad_accum * m
        return (n / calls).clamp(min=1.0 / calls).float()

    def _global_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel ranks (every rank holds the same number of samples)."""
        if self.ctx.distributed and self.strategy.dp_size > 1:
            values = values.clone()
            dist.all_reduce(values, group=self.strategy.dp_group)
            values /= self.strategy.dp_size
        return values

    def flush_losses(self) -> None:
        """Average the pending per-step losses over ranks (one all-reduce) and append them to ``losses``."""
        pending = self.state.pending
        if pending:
            self.state.losses.extend(self._global_mean(torch.stack(pending).float()).tolist())
            pending.clear()

    # ---- the loop -------------------------------------------------------------------------------------
    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns this rank's mean loss over its micro-batches (on the device)."""
        st, t = self.state, self.cfg.train
        self.model.train()
        self.step_lr = float(st.scheduler.get_last_lr()[0])  # this step's rate: the schedule moves after it
        with record_function("paratrain.data"):  # labelled spans of --profile's traces
            batch = self.data.train.batch(st.sampler.next_batch())
            if self.data.train.transform is not None:
                batch = Batch(self.data.train.transform(batch.inputs, st.augment), batch.targets)
            batch = batch.to(self.ctx.device, non_blocking=True)
            if self.masked_lm:
                self.tokens_per_call = self._predicted_tokens_per_call(batch.targets)
        self.optimizer.zero_grad(set_to_none=True)
        with record_function("paratrain.forward_backward"):
            loss = self.strategy.forward_backward(self.model, batch, self._loss, st.precision, t.grad_accum)
        # fp16: the GradScaler skips steps whose scaled gradients overflowed; only the loss is checked here
        share = (self.strategy.dp_rank, self.strategy.dp_size) if self.strategy.replicated_gradients else None
        bad = check_finite(self.model, loss, self.ctx, check_grads=st.precision.scaler is None, share=share)
        if bad:
            if t.on_nonfinite == "skip" and self.nonfinite_skips < t.max_nonfinite_skips:
                self.nonfinite_skips += 1
                self.log.warning("skipping step %d: non-finite loss or gradient on rank(s) %s (%d/%d skips)",
                                 st.step + 1, bad, self.nonfinite_skips, t.max_nonfinite_skips)  # fmt: skip
                self.optimizer.zero_grad(set_to_none=True)
                return loss
            raise NonFiniteError(describe(st.step + 1, bad, self.ctx, self.model, loss))
        with record_function("paratrain.optimizer"):
            if self.cfg.optimizer.grad_clip is not None:
                st.precision.unscale(self.optimizer)
                self.grad_norm = self.strategy.clip_grad_norm(self.model, self.cfg.optimizer.grad_clip)
            st.precision.step(self.optimizer)
            st.scheduler.step()
        if self.moe_stats is not None:  # expert counts summed over the data-parallel ranks, bias updated
            self.moe_stats = after_optimizer_step(self.model, self.strategy.moe_group, t.grad_accum)
        return loss

    def _console(self, start_step: int, lines: bool) -> ConsoleLog:
        """Rank 0's header (printed now) and progress lines (:mod:`paratrain.train.console`)."""
        t, data = self.cfg.train, self.data
        seq = int(data.train.x.shape[1]) if data.task == "lm" else None
        console = ConsoleLog(self.ctx, every=t.log_every, lines=lines, start_step=start_step,
                             total_steps=self.state.total_steps, batch_size=t.batch_size, tokens_per_sample=seq)  # fmt: skip
        console.print(header(
            strategy=self.strategy.name, degrees=self.strategy.topology.degrees(), world_size=self.ctx.world_size,
            batch_size=t.batch_size, dp_size=self.strategy.dp_size, grad_accum=t.grad_accum, start_step=start_step,
            total_steps=self.state.total_steps, precision=t.precision, dataset=self.cfg.data.name,
            train_samples=len(data.train), test_samples=len(data.test), tokens_per_sample=seq))  # fmt: skip
        return console

    def eval_size(self) -> int:
        """Test samples each evaluation covers: the first ``eval_batches`` global batches (all with 0)."""
        n, cap = len(self.data.test), self.cfg.train.eval_batches
        if cap is None:
            cap = LM_EVAL_BATCHES if self.data.task == "lm" else EVAL_BATCHES
        return min(n, cap * self.cfg.train.batch_size) if cap else n

    @torch.no_grad()
    def evaluate(
        self, batch_size: int = 512, console: ConsoleLog | None = None
    ) -> tuple[float | None, float]:
        """Accuracy (classification) and mean loss on the first :meth:`eval_size` samples of the test split,
        split across data-parallel ranks.

        Every rank runs the same number of forward passes (sharded models communicate in forward), padding
        with weight-0 samples; correct/count/loss sums are all-reduced, so the totals are exact. For a
        language model the loss is the mean over every predicted token, and there is no accuracy.
        """
        model = self.model
        model.eval()
        test, task = self.data.test, self.data.task
        n, r, w = self.eval_size(), self.strategy.dp_rank, self.strategy.dp_size
        e0 = time.perf_counter()
        if console is not None:
            console.print(
                f"step {self.state.step}: evaluating on {n:,} of {len(test):,} test samples (--eval-batches)"
            )
        mine = torch.arange(r, n, w)
        per_rank = -(-n // w)
        pad = per_rank - len(mine)
        weights = torch.cat([torch.ones(len(mine)), torch.zeros(pad)])
        mine = torch.cat([mine, torch.zeros(pad, dtype=torch.long)])
        sums = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # correct, count, loss sum
        for start in range(0, per_rank, batch_size):
            sl = slice(start, start + batch_size)
            batch = test.batch(mine[sl]).to(self.ctx.device)
            wt = weights[sl].to(self.ctx.device, torch.float64)
            with self.state.precision.autocast():
                out = self.strategy.evaluate_forward(model, batch.inputs)
            if out is None:  # a pipeline stage without the head: the last stage counts
                continue
            out, y = out.float(), batch.targets
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
        if self.ctx.distributed and self.ctx.world_size > 1:
            # every rank joins: a pipeline's non-last stages contribute zeros, replicas their shares
            dist.all_reduce(sums, group=self.strategy.eval_group())
        model.train()
        acc = float(sums[0] / sums[1]) if task == "classification" else None
        loss = float(sums[2] / sums[1])
        if console is not None:
            shown = f"eval loss {loss:.4f}" + (f", accuracy {acc:.2%}" if acc is not None else "")
            console.print(f"step {self.state.step}: {shown} ({time.perf_counter() - e0:.1f} s)")
        return acc, loss

    def fit(self) -> TrainResult:
        t, st = self.cfg.train, self.state
        self.lifecycle.resume()
        start_step = st.step
        if start_step >= st.total_steps and self.ctx.is_main:
            print(f"[paratrain] already at step {start_step} (the checkpoint resumed from), which is not before "
                  f"--steps {st.total_steps}: nothing to train. Raise --steps to continue training.",
                  file=sys.stderr, flush=True)  # fmt: skip
        logged = st.losses
        bar = _progress(self.ctx, t.progress, st.total_steps, start_step)
        console = self._console(start_step, lines=bar is None)
        metrics_every = t.log_every or 10
        self.observers.begin(st.step, st.total_steps)  # the trackers start their runs: not training time
        self.ctx.synchronize()
        on_cuda = self.ctx.device.type == "cuda"
        if on_cuda:  # the caching allocator's peak over the training steps (not start-up, not evaluation)
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        t0 = time.perf_counter()
        eval_time = 0.0
        self.lifecycle.install_signal_handlers()
        # peer_guard: a collective that fails because a peer died or hung is re-raised naming that rank.
        peak: int | None = None
        tracked_s = 0.0  # seconds of the memory-tracked step
        measure_at = start_step + 1 if st.total_steps - start_step > 1 else start_step  # after a warm-up step
        with peer_guard(self.ctx) as peers:
            while st.step < st.total_steps:
                if (
                    st.step == measure_at and self.strategy.measures_peak_memory
                ):  # one step under the memory tracker: the peak of live bytes
                    m0 = time.perf_counter()
                    loss, peak = measure_peak(
                        self.train_step, self.model, self.optimizer, self.log, self.strategy.peak_by_module
                    )
                    tracked_s = time.perf_counter() - m0  # slowed by the tracker: kept out of throughput
                    st.pending.append(loss)
                else:
                    st.pending.append(self.train_step())
                st.step += 1
                if peers is not None:
                    peers.step = st.step
                if bar is not None:
                    bar.update(1)
                if st.step == console.calibrate_at:  # every rank: rank 0's step time sets the cadence
                    timed = st.step - start_step - (1 if tracked_s else 0)
                    console.calibrate(st.step, time.perf_counter() - t0 - eval_time - tracked_s, timed)
                show = console.due(st.step)
                if show or st.step % metrics_every == 0 or st.step == st.total_steps:
                    self.flush_losses()
                    train_s = time.perf_counter() - t0 - eval_time
                    if bar is not None:
                        bar.set_postfix(loss=f"{logged[-1]:.4f}")
                    if show:
                        console.step_line(st.step, logged[-1], self.step_lr, train_s - tracked_s)
                    if st.step % metrics_every == 0 or st.step == st.total_steps:
                        self.observers.on_step_end(st.step, {
                            "step": st.step, "loss": logged[-1], "lr": self.step_lr,
                            "train_time_s": train_s, "grad_norm": self.grad_norm, "peak_bytes": peak,
                            **({"moe": self.moe_stats} if self.moe_stats else {})})  # fmt: skip
                if t.eval_every and st.step % t.eval_every == 0 and st.step < st.total_steps:
                    e0 = time.perf_counter()
                    acc_i, eloss_i = self.evaluate(console=console)
                    self.observers.on_eval(
                        st.step, {"step": st.step, "eval_accuracy": acc_i, "eval_loss": eloss_i}
                    )
                    self.lifecycle.keep_if_best(eloss_i)
                    eval_time += time.perf_counter() - e0
                if t.check_desync_every and st.step % t.check_desync_every == 0:
                    # replicas must hold identical parameters: compare digests across the data-parallel
                    # ranks (a pipeline's stages hold different layers by design)
                    check_desync(self.model, st.step, group=self.strategy.dp_group)
                e0 = time.perf_counter()
                # async-save poll, fault injection, coordinated stop on a signal, periodic save
                stop = self.lifecycle.after_step()
                eval_time += time.perf_counter() - e0
                self.observers.after_step(st.step)  # --profile's schedule
                if stop:
                    break
        self.lifecycle.restore_signal_handlers()
        self.ctx.synchronize()
        cuda_peaks = (
            [
                torch.cuda.max_memory_allocated(self.ctx.device),
                torch.cuda.max_memory_reserved(self.ctx.device),
            ]
            if on_cuda
            else [0, 0]
        )
        train_time = time.perf_counter() - t0 - eval_time - tracked_s
        if bar is not None:
            bar.close()
        steps_run = st.step - start_step
        timed_steps = steps_run - (1 if tracked_s else 0)  # the memory-tracked step is not timed
        samples_per_s = (
            timed_steps * t.batch_size / train_time if timed_steps > 0 and train_time > 0 else None
        )
        self.flush_losses()
        acc, eloss = None, None
        if not self.lifecycle.stopped_by:  # a signal-stopped run skips evaluation to exit quickly
            acc, eloss = self.evaluate(console=console)
            self.lifecycle.keep_if_best(eloss)
        self.observers.on_eval(
            st.step, {"step": st.step, "eval_accuracy": acc, "eval_loss": eloss, "final": True}
        )
        ckpt_path = self.lifecycle.finish(steps_run)  # final save, and wait for any async save in flight
        mem = torch.tensor(  # on the backend's device: NCCL has no CPU tensors
            [model_state_bytes(self.model, self.optimizer), peak or 0, *cuda_peaks],
            dtype=torch.int64,
            device=self.ctx.device,
        )
        if self.ctx.distributed:
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)  # the largest rank's figures
        state_bytes, peak_bytes = int(mem[0]), (int(mem[1]) or None) if peak is not None else None
        params = full_parameters(self.model)
        sha, norm = param_digest(params) if params is not None else (None, None)
        self.observers.close()  # with --profile: gathers every rank's profile summary on rank 0
        extra: dict[str, Any] = {
            "global_batch_size": t.batch_size,
            "grad_accum": t.grad_accum,
            "precision": t.precision,
            "comm_algorithm": self.cfg.strategy.comm_algorithm,
            "train_time_s": train_time,
            "run_dir": str(self.run_dir),
            "checkpoint": ckpt_path,
            "checkpoint_blocked_s": list(self.ckpt.blocked_s),
            "stopped_by_signal": self.lifecycle.stopped_by,
            "device": self.ctx.device.type,
            "backend": self.ctx.backend,
            "topology": self.strategy.topology.degrees(),
            "peak_bytes_per_rank": peak_bytes,
            # what the GPU's caching allocator saw (torch.cuda.max_memory_allocated / _reserved) over the
            # training steps; null on the CPU. Allocated counts live tensors; reserved adds the cached blocks.
            "cuda_peak_allocated_bytes_per_rank": int(mem[2]) if on_cuda else None,
            "cuda_peak_reserved_bytes_per_rank": int(mem[3]) if on_cuda else None,
            "nonfinite_skipped_steps": self.nonfinite_skips,
        }
        if self.moe_stats is not None:
            extra["moe"] = self.moe_stats or None
        if self.data.task == "lm":
            seq = int(self.data.train.x.shape[1])
            extra["tokens_per_s"] = samples_per_s * seq if samples_per_s is not None else None
            extra["eval_perplexity"] = math.exp(min(eloss, 700.0)) if eloss is not None else None
            extra["mfu"] = model_flops_utilization(
                self.model, self.ctx, seq, extra["tokens_per_s"], t.precision
            )
        return TrainResult(
            strategy=self.strategy.name,
            world_size=self.ctx.world_size,
            num_params=self.num_params,
            steps=st.step,
            losses=logged,
            final_loss=logged[-1] if logged else None,
            eval_accuracy=acc,
            eval_loss=eloss,
            samples_per_s=samples_per_s,
            param_sha256=sha,
            param_norm=norm,
            model_state_bytes_per_rank=state_bytes,
            restarts=self.ctx.restart_count,
            resumed_from_step=st.resumed_from,
            extra=extra,
        )


def device_peak_flops(device: torch.device, precision: str = "bf16") -> float | None:
    """Peak dense FLOP/s of ``device`` at ``precision`` (16-bit for bf16/fp16), or ``None`` when unknown
    (CPUs, and GPUs not in the table). Used for MFU; never guessed."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return gpu_peak_flops(torch.cuda.get_device_name(device), precision)


def model_flops_utilization(
    model: nn.Module, ctx: Context, seq_len: int, tokens_per_s: float | None, precision: str
) -> float | None:
    """Achieved FLOP/s over the devices' peak (PaLM's MFU): ``tokens/s x FLOPs per token / (world x peak)``,
    with FLOPs per token from the model's spec (``6·N + 12·L·H·Q·T``, :func:`paratrain.models.llama.
    flops_per_token`; a Hugging Face model's from its config). ``None`` when the peak of the device is not
    known (every CPU) or the model's spec has no FLOPs count."""
    from paratrain.models.spec import spec_of

    inner = getattr(model, "module", model)  # DDP's wrapped module
    spec = spec_of(inner)
    peak = device_peak_flops(ctx.device, precision)
    if spec is None or spec.flops_per_token is None or peak is None or not tokens_per_s:
        return None
    return tokens_per_s * spec.flops_per_token(inner, seq_len) / (ctx.world_size * peak)


def checkpoint_writer_factory(rank: int) -> Any:
    """The checkpoint writer of this rank: the hashing DCP writer, or (fault injection,
    ``PARATRAIN_FAIL_CKPT_WRITE=R`` names this rank) one whose data write raises."""
    from paratrain.checkpoint.integrity import HashingWriter

    if os.environ.get("PARATRAIN_FAIL_CKPT_WRITE") != str(rank):
        return None  # the manager's default

    class FailingWriter(HashingWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            raise OSError(f"injected checkpoint write failure on rank {rank} (PARATRAIN_FAIL_CKPT_WRITE)")

    return FailingWriter


def loss_function(task: str) -> Any:
    """The training loss of a task: cross-entropy (classification; next-token for ``lm``) or MSE."""

    def classification(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float(), y)

    def lm(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())

    def regression(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(out.float(), y)

    return {"classification": classification, "lm": lm, "regression": regression}[task]


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
