"""What the training loop calls around its steps so that a run survives anything.

- :meth:`RunLifecycle.resume` (before the loop): pick the checkpoint (``--resume auto|never|PATH``; auto skips
  corrupt or partial checkpoints with a warning), load model/optimizer via DCP (resharding across world
  sizes and strategies), and restore the :class:`~paratrain.train.state.TrainState` (step, sampler position,
  scheduler, GradScaler, the logged loss curve) and this rank's RNG streams.
- :meth:`RunLifecycle.after_step` (after every optimizer step): commit a finished async save (or raise its
  error), fault injection, the coordinated stop on SIGTERM/SIGUSR1, periodic saves.
- :meth:`RunLifecycle.finish` (after the loop): the final save, and waiting for any save in flight.

Coordinated stop on a signal. The handler only sets a flag. Ranks must agree on *which* step to stop at
(they receive the signal at different times), so after step ``t`` each rank starts a non-blocking MAX
all-reduce of its flag and waits for it only after step ``t+1``: the agreement overlaps a whole step of
compute and adds no stall. Every rank launches exactly one such all-reduce per step, in the same order
relative to the strategy's collectives, so the sequences match across ranks. When the reduced flag is set,
every rank saves at the same step and the loop stops.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint import CheckpointManager, step_dir_name
from paratrain.checkpoint.state import rng_state, set_rng_state
from paratrain.config import RunConfig
from paratrain.runtime import Context, attempt, seed_everything
from paratrain.train.faults import maybe_fail
from paratrain.train.state import TrainState

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class RunLifecycle:
    def __init__(
        self,
        state: TrainState,
        ckpt: CheckpointManager,
        model: nn.Module,
        optimizer: Any,
        cfg: RunConfig,
        ctx: Context,
        run_info: dict[str, Any],
        dp_rank: int,
        flush_losses: Callable[[], None],
        log: logging.Logger,
    ) -> None:
        self.state = state
        self.ckpt = ckpt
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.ctx = ctx
        self.run_info = run_info
        """Saved with every checkpoint: strategy, dp_size, num_params (read back by ``ckpt inspect``)."""
        self.dp_rank = dp_rank
        self.flush_losses = flush_losses
        self.log = log
        self.stopped_by: str | None = None
        self._received: int = 0
        self._flag = torch.zeros(2, dtype=torch.int32, device=ctx.device)  # [signal, async save failed]
        self._work: Any = None
        self._last_saved: int | None = None
        self._old_handlers: dict[int, Any] = {}
        self._best_loss = float("inf")
        self.resumed_path: str | None = None
        """The checkpoint this run resumed from (the run's checkpoint when it trains no step)."""

    # ---- signals ------------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._received = signum

    def _agree(self, failed: bool) -> tuple[int, bool]:
        """``(signal, some rank's async save failed)`` reduced over ranks one step ago; starts this step's
        reduction (see module doc)."""
        if not self.ctx.distributed:
            return self._received, failed
        agreed = (0, False)
        if self._work is not None:
            self._work.wait()
            sig, bad = self._flag.tolist()
            agreed = (int(sig), bool(bad))
        self._flag.copy_(torch.tensor([self._received, int(failed)], dtype=torch.int32))
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, async_op=True)
        return agreed

    # ---- saving ---------------------------------------------------------------------------------------------
    def save(self) -> str:
        self.flush_losses()  # the saved curve must reach the saved step (losses are flushed lazily)
        st = self.state
        train_state = {**st.to_json(), **self.run_info, "config": self.cfg.to_dict()}
        rank_state = rng_state({"augment": st.augment})
        path = self.ckpt.save(st.step, self.model, self.optimizer, train_state, rank_state)
        self._last_saved = st.step
        return str(path)

    # ---- the three hooks ------------------------------------------------------------------------------------
    def resume(self) -> None:
        st, mode = self.state, self.cfg.checkpoint.resume

        # the launcher already printed what it skipped before launch (same checks): say it once
        already = (
            set(json.loads(os.environ.get("PARATRAIN_REPORTED_SKIPS") or "[]")) if attempt() == 0 else set()
        )

        def skipped(path: Any, problems: list[str]) -> None:
            log = self.log.debug if os.path.abspath(path) in already else self.log.warning
            log("skipping checkpoint %s: %s", path, "; ".join(problems))

        loaded = None
        since = self._job_start() if attempt() > 0 and mode != "auto" else None
        if since is not None:
            # A restart (--max-restarts) resumes from the newest checkpoint this job committed, whatever
            # --resume said for the first start; with none yet, it starts as the first start did.
            loaded = self.ckpt.load_latest_valid(
                self.model, self.optimizer, on_skip=skipped if self.ctx.is_main else None, since=since
            )
        if loaded is None and mode == "never":
            return
        if loaded is None and mode == "auto":
            # the newest checkpoint whose every file matches its committed checksum, and that loads; the
            # ranks split the hashing and agree, then fall back past damaged ones together
            loaded = self.ckpt.load_latest_valid(
                self.model, self.optimizer, on_skip=skipped if self.ctx.is_main else None
            )
            if loaded is None:
                return
        elif loaded is None:
            loaded = self.ckpt.load(Path(mode), self.model, self.optimizer)
        saved = loaded.train_state
        saved_bs = saved.get("config", {}).get("train", {}).get("batch_size")
        st.load_json(saved, keep_losses=saved_bs == self.cfg.train.batch_size)
        if loaded.rank_state is not None:
            set_rng_state(loaded.rank_state, {"augment": st.augment})
        else:
            # Another world size: there is no saved stream for this rank. Re-derive every stream from
            # (seed, step, rank) so the continuation is deterministic (though not bitwise equal to any
            # uninterrupted run: the random numbers are drawn from different streams).
            seed = self.cfg.train.seed
            seed_everything(seed * 1_000_003 + st.step * 7919 + self.ctx.rank)
            st.augment.manual_seed(seed * 1000 + self.dp_rank + st.step * 7919)
        self._last_saved = st.step
        self.resumed_path = str(loaded.path)
        self.log.info(
            "resumed from %s (step %d, saved with world size %s, strategy %s)",
            loaded.path,
            st.step,
            saved.get("world_size"),
            saved.get("strategy"),
        )

    def _job_start(self) -> float | None:
        """When ``paratrain train`` started this job (``PARATRAIN_JOB_START``), as rank 0 knows it: every
        rank must pick the same checkpoints."""
        raw = os.environ.get("PARATRAIN_JOB_START")
        start = [float(raw) if raw else None]
        if self.ctx.distributed:
            dist.broadcast_object_list(start, src=0)
        return start[0]

    def after_step(self) -> bool:
        """Run after optimizer step ``state.step``; ``True`` means stop now (a coordinated save was made)."""
        st = self.state
        error = self.ckpt.poll()
        maybe_fail(st.step, self.ctx, self.cfg.launch.fail_at_step, self.cfg.launch.fail_rank)
        sig, failed = self._agree(error is not None)
        if failed:
            from paratrain.checkpoint.async_save import AsyncCheckpointError

            raise error or AsyncCheckpointError(
                f"rank {self.ctx.rank}: a background checkpoint save failed on another rank (its log names it)"
            )
        if sig:
            self.stopped_by = signal.Signals(sig).name
            if self._last_saved != st.step:
                self.save()
            self.ckpt.wait()
            if self.ctx.is_main:
                print(
                    f"[paratrain] {self.stopped_by}: saved a checkpoint at step {st.step} and stopped; "
                    "run the same command again to resume",
                    file=sys.stderr,
                    flush=True,
                )
            return True
        every = self.cfg.checkpoint.every
        if every and st.step % every == 0 and st.step < st.total_steps:
            self.save()
        return False

    def keep_if_best(self, eval_loss: float | None) -> None:
        """``--keep-best``, after an evaluation, on every rank: a lower eval loss than any before in this job
        saves a checkpoint at this step (unless just saved) and names it in ``DIR/best``."""
        if not self.cfg.train.keep_best or eval_loss is None or not eval_loss < self._best_loss:
            return
        self._best_loss = eval_loss
        if self._last_saved != self.state.step:
            self.save()
        self.ckpt.wait()  # an async save must be committed before ``best`` names it
        self.ckpt.mark_best(self.state.step, eval_loss)

    def finish(self, steps_run: int) -> str | None:
        """Final save (unless just saved) and wait for saves in flight; returns the last checkpoint path."""
        st = self.state
        if self._work is not None:
            self._work.wait()  # every rank launched the same number of flag reductions
            self._work = None
        path = None
        if self.stopped_by is None and self.cfg.checkpoint.save_at_end and steps_run > 0:
            path = (
                self.save() if self._last_saved != st.step else str(self.ckpt.root / step_dir_name(st.step))
            )
        self.ckpt.wait()
        self.ckpt.close()
        if self.stopped_by is not None:
            path = str(self.ckpt.root / step_dir_name(st.step))
        if path is None and steps_run == 0:  # nothing trained: the checkpoint resumed from is still the run's
            path = self.resumed_path
        return path
