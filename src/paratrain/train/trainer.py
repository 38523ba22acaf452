"""The training loop: accumulation, precision, clipping, periodic evaluation, metrics, checkpoints.

One optimizer step, on every rank:

    batch = data.train.batch(sampler.next_batch())      # this rank's B/W samples of global batch t
    loss = strategy.forward_backward(model, batch, loss_fn, precision, K)
        # default: K = grad_accum micro-batches, no_sync() on all but the last, backward(loss_k / K);
        # a pipeline schedule runs its own interleaving of micro-batches over the stages instead
    clip (global norm) -> optimizer.step() -> scheduler.step()

Per-step losses stay on the device and are averaged over ranks in one all-reduce at logging time, not
every step, so logging adds no synchronisation to the hot loop. Evaluation is :mod:`paratrain.train.evaluate`,
the end-of-run summary (digest, memory, MFU) :mod:`paratrain.train.summary`.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from paratrain.checkpoint import CheckpointManager
from paratrain.config import RunConfig
from paratrain.data import Batch, DistributedBatchSampler, Splits
from paratrain.models.moe import MoE, after_optimizer_step, merge_stage_stats, moe_layers, pop_aux_loss
from paratrain.parallel import Strategy, model_state_bytes
from paratrain.runtime import Context, get_logger
from paratrain.train.console import ConsoleLog, header, progress_bar
from paratrain.train.desync import check_desync
from paratrain.train.evaluate import eval_size, evaluate
from paratrain.train.faults import checkpoint_writer_factory, peer_guard
from paratrain.train.lifecycle import RunLifecycle
from paratrain.train.loss import IGNORE_LABEL, loss_function
from paratrain.train.memory import measure_peak
from paratrain.train.metrics import MetricsWriter
from paratrain.train.nonfinite import NonFiniteError, check_finite, describe
from paratrain.train.observe import RunObservers
from paratrain.train.optim import build_optimizer, build_scheduler, set_implementation
from paratrain.train.precision import Precision
from paratrain.train.state import TrainState
from paratrain.train.summary import (
    TrainResult,
    full_parameters,
    gather_memory,
    model_flops_utilization,
    param_digest,
)

__all__ = ["TrainResult", "Trainer", "build_optimizer", "build_scheduler", "full_parameters", "param_digest"]


@dataclass
class _Run:
    """One :meth:`Trainer.fit` call's progress display and clock (what counts as training time)."""

    start_step: int
    bar: Any
    """tqdm's bar on rank 0 at a terminal, else ``None``."""
    console: ConsoleLog
    measure_at: int
    """The step run under the memory tracker (after a warm-up step when there are two or more)."""
    t0: float = 0.0
    eval_s: float = 0.0
    """Seconds spent evaluating and in the per-step lifecycle (saves): kept out of throughput."""
    tracked_s: float = 0.0
    """Seconds of the memory-tracked step, slowed by the tracker: kept out of throughput."""
    peak: int | None = None
    """Live bytes of the memory-tracked step."""

    def train_s(self) -> float:
        return time.perf_counter() - self.t0 - self.eval_s


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
        self.optimizer_implementation = set_implementation(optimizer, cfg.optimizer.implementation)
        """What runs the update (``optimizer.implementation``: ``fused``, ``foreach`` or ``for-loop``)."""
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
        self.moe_stats: dict[str, Any] | None = {} if moe_layers(model) or self._moe_stages() else None
        """MoE models: the last step's expert load (:func:`paratrain.models.moe.after_optimizer_step`)."""
        self.nonfinite_skips = 0
        """Steps skipped because of a non-finite loss or gradient (``--set train.on_nonfinite=skip``)."""
        self.masked_lm = data.task == "lm" and bool((data.train.y == IGNORE_LABEL).any())
        """Labels with ignored positions (``jsonl`` prompt/completion): the loss is normalised per step."""
        self.tokens_per_call: torch.Tensor | None = None
        """Masked labels: the global batch's predicted tokens / the loss calls of one step over all ranks."""

    @property
    def _on_cuda(self) -> bool:
        return self.ctx.device.type == "cuda"

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
            if self._moe_stages():  # each stage counted its own blocks: one table of every block, in order
                names = [n for n, m in self.model.named_modules() if isinstance(m, MoE)]
                parts: list[Any] = [None] * self.strategy.topology.pp
                dist.all_gather_object(
                    parts, (names, self.moe_stats), group=self.strategy.axis_group(("pp",))
                )
                self.moe_stats = merge_stage_stats(parts) or {}
        return loss

    def _moe_stages(self) -> bool:
        """Expert parallelism over pipeline stages: every stage rank joins the stages' expert-load gather,
        also a stage without MoE blocks."""
        return bool(self.strategy.uses_ep and self.strategy.uses_pp and self.strategy.topology.pp > 1)

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
        """Test samples each evaluation covers (:func:`paratrain.train.evaluate.eval_size`)."""
        return eval_size(self.data, self.cfg.train)

    def evaluate(
        self, batch_size: int = 512, console: ConsoleLog | None = None
    ) -> tuple[float | None, float]:
        """Accuracy (classification) and mean loss on the first :meth:`eval_size` test samples, split across
        the data-parallel ranks (:func:`paratrain.train.evaluate.evaluate`). Collective."""
        return evaluate(self.model, self.strategy, self.data, self.ctx, self.state.precision, self.eval_size(),
                        step=self.state.step, batch_size=batch_size, console=console)  # fmt: skip

    # ---- fit: the run from resume to summary ------------------------------------------------------
    def fit(self) -> TrainResult:
        """Resume, train to ``total_steps`` (or a coordinated stop), evaluate, save, and summarise."""
        self.lifecycle.resume()
        # a loaded checkpoint's param groups carry the saving run's options: this run's choice again
        set_implementation(self.optimizer, self.cfg.optimizer.implementation)
        run = self._begin()
        # peer_guard: a collective that fails because a peer died or hung is re-raised naming that rank.
        with peer_guard(self.ctx) as peers:
            while self.state.step < self.state.total_steps:
                self._run_step(run)
                if peers is not None:
                    peers.step = self.state.step
                self._after_step_reports(run)
                if self._after_step_housekeeping(run):
                    break
        return self._finish(run)

    def _begin(self) -> _Run:
        """The header, the progress display, the peak-memory counters and the signal handlers."""
        t, st = self.cfg.train, self.state
        start_step = st.step
        if start_step >= st.total_steps and self.ctx.is_main:
            print(f"[paratrain] already at step {start_step} (the checkpoint resumed from), which is not before "
                  f"--steps {st.total_steps}: nothing to train. Raise --steps to continue training.",
                  file=sys.stderr, flush=True)  # fmt: skip
        bar = progress_bar(self.ctx, t.progress, st.total_steps, start_step)
        console = self._console(start_step, lines=bar is None)
        measure_at = start_step + 1 if st.total_steps - start_step > 1 else start_step  # after a warm-up step
        run = _Run(start_step, bar, console, measure_at)
        self.observers.begin(st.step, st.total_steps)  # the trackers start their runs: not training time
        self.ctx.synchronize()
        # the caching allocator's peak over the training steps (not start-up, not evaluation)
        if self._on_cuda:
            torch.cuda.reset_peak_memory_stats(self.ctx.device)
        run.t0 = time.perf_counter()
        self.lifecycle.install_signal_handlers()
        return run

    def _run_step(self, run: _Run) -> None:
        """One optimizer step (one under the memory tracker: the peak of live bytes); its loss is pending."""
        st = self.state
        if st.step == run.measure_at and self.strategy.measures_peak_memory:
            m0 = time.perf_counter()
            loss, run.peak = measure_peak(
                self.train_step, self.model, self.optimizer, self.log, self.strategy.peak_by_module
            )
            run.tracked_s = time.perf_counter() - m0  # slowed by the tracker: kept out of throughput
            st.pending.append(loss)
        else:
            st.pending.append(self.train_step())
        st.step += 1
        if run.bar is not None:
            run.bar.update(1)

    def _after_step_reports(self, run: _Run) -> None:
        """Progress line, metrics and observers at their cadence; evaluation and the desync check at theirs."""
        t, st, console = self.cfg.train, self.state, run.console
        if st.step == console.calibrate_at:  # every rank: rank 0's step time sets the cadence
            timed = st.step - run.start_step - (1 if run.tracked_s else 0)
            console.calibrate(st.step, run.train_s() - run.tracked_s, timed)
        metrics_due = st.step % (t.log_every or 10) == 0 or st.step == st.total_steps
        show = console.due(st.step)
        if show or metrics_due:
            self._log_step(run, show, metrics_due)
        if t.eval_every and st.step % t.eval_every == 0 and st.step < st.total_steps:
            e0 = time.perf_counter()
            acc, eval_loss = self.evaluate(console=console)
            self.observers.on_eval(st.step, {"step": st.step, "eval_accuracy": acc, "eval_loss": eval_loss})
            self.lifecycle.keep_if_best(eval_loss)
            run.eval_s += time.perf_counter() - e0
        if t.check_desync_every and st.step % t.check_desync_every == 0:
            # replicas must hold identical parameters: compare digests across the data-parallel
            # ranks (a pipeline's stages hold different layers by design)
            check_desync(self.model, st.step, group=self.strategy.dp_group)

    def _log_step(self, run: _Run, show: bool, metrics_due: bool) -> None:
        """Average the pending losses over ranks (collective), then print and record them."""
        st, logged = self.state, self.state.losses
        self.flush_losses()
        train_s = run.train_s()
        if run.bar is not None:
            run.bar.set_postfix(loss=f"{logged[-1]:.4f}")
        if show:
            run.console.step_line(st.step, logged[-1], self.step_lr, train_s - run.tracked_s)
        if metrics_due:
            self.observers.on_step_end(st.step, {
                "step": st.step, "loss": logged[-1], "lr": self.step_lr,
                "train_time_s": train_s, "grad_norm": self.grad_norm, "peak_bytes": run.peak,
                **({"moe": self.moe_stats} if self.moe_stats else {})})  # fmt: skip

    def _after_step_housekeeping(self, run: _Run) -> bool:
        """Async-save poll, fault injection, coordinated stop on a signal, periodic save, the profiler's
        schedule; whether the run stops here."""
        e0 = time.perf_counter()
        stop = self.lifecycle.after_step()
        run.eval_s += time.perf_counter() - e0
        self.observers.after_step(self.state.step)  # --profile's schedule
        return stop

    def _finish(self, run: _Run) -> TrainResult:
        """Stop the clock, evaluate, make the final save, and gather the summary (collective)."""
        t, st = self.cfg.train, self.state
        self.lifecycle.restore_signal_handlers()
        self.ctx.synchronize()
        cuda_peaks = None
        if self._on_cuda:
            cuda_peaks = [torch.cuda.max_memory_allocated(self.ctx.device),
                          torch.cuda.max_memory_reserved(self.ctx.device)]  # fmt: skip
        train_time = run.train_s() - run.tracked_s
        if run.bar is not None:
            run.bar.close()
        steps_run = st.step - run.start_step
        timed_steps = steps_run - (1 if run.tracked_s else 0)  # the memory-tracked step is not timed
        samples_per_s = (
            timed_steps * t.batch_size / train_time if timed_steps > 0 and train_time > 0 else None
        )
        self.flush_losses()
        acc, eval_loss = None, None
        if not self.lifecycle.stopped_by:  # a signal-stopped run skips evaluation to exit quickly
            acc, eval_loss = self.evaluate(console=run.console)
            self.lifecycle.keep_if_best(eval_loss)
        self.observers.on_eval(
            st.step, {"step": st.step, "eval_accuracy": acc, "eval_loss": eval_loss, "final": True}
        )
        ckpt_path = self.lifecycle.finish(steps_run)  # final save, and wait for any async save in flight
        mem = gather_memory(self.model, self.optimizer, self.ctx, run.peak, cuda_peaks)
        params = full_parameters(self.model)
        sha, norm = param_digest(params) if params is not None else (None, None)
        self.observers.close()  # with --profile: gathers every rank's profile summary on rank 0
        extra: dict[str, Any] = {
            "global_batch_size": t.batch_size,
            "grad_accum": t.grad_accum,
            "precision": t.precision,
            "comm_algorithm": self.cfg.strategy.comm_algorithm,
            "optimizer_implementation": self.optimizer_implementation,
            "train_time_s": train_time,
            "run_dir": str(self.run_dir),
            "checkpoint": ckpt_path,
            "checkpoint_blocked_s": list(self.ckpt.blocked_s),
            "stopped_by_signal": self.lifecycle.stopped_by,
            "device": self.ctx.device.type,
            "backend": self.ctx.backend,
            "topology": self.strategy.topology.degrees(),
            "peak_bytes_per_rank": mem.peak,
            # what the GPU's caching allocator saw (torch.cuda.max_memory_allocated / _reserved) over the
            # training steps; null on the CPU. Allocated counts live tensors; reserved adds the cached blocks.
            "cuda_peak_allocated_bytes_per_rank": mem.cuda_allocated,
            "cuda_peak_reserved_bytes_per_rank": mem.cuda_reserved,
            "nonfinite_skipped_steps": self.nonfinite_skips,
        }
        if self.moe_stats is not None:
            extra["moe"] = self.moe_stats or None
        if self.data.task == "lm":
            extra.update(self._lm_figures(samples_per_s, eval_loss))
        logged = st.losses
        return TrainResult(
            strategy=self.strategy.name,
            world_size=self.ctx.world_size,
            num_params=self.num_params,
            steps=st.step,
            losses=logged,
            final_loss=logged[-1] if logged else None,
            eval_accuracy=acc,
            eval_loss=eval_loss,
            samples_per_s=samples_per_s,
            param_sha256=sha,
            param_norm=norm,
            model_state_bytes_per_rank=mem.model_state,
            restarts=self.ctx.restart_count,
            resumed_from_step=st.resumed_from,
            extra=extra,
        )

    def _lm_figures(self, samples_per_s: float | None, eval_loss: float | None) -> dict[str, Any]:
        """A language model's ``tokens_per_s``, ``eval_perplexity`` and ``mfu``."""
        seq = int(self.data.train.x.shape[1])
        tokens_per_s = samples_per_s * seq if samples_per_s is not None else None
        return {
            "tokens_per_s": tokens_per_s,
            "eval_perplexity": math.exp(min(eval_loss, 700.0)) if eval_loss is not None else None,
            "mfu": model_flops_utilization(self.model, self.ctx, seq, tokens_per_s, self.cfg.train.precision),
        }
