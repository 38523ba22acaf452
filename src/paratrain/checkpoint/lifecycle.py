"""What the training loop calls around its steps so that a run survives anything.

- :meth:`RunLifecycle.resume` (before the loop): pick the checkpoint (``--resume auto|never|PATH``; auto skips
  corrupt or partial checkpoints with a warning), load model/optimizer via DCP (resharding across world
  sizes and strategies), and restore step, sampler position, scheduler, GradScaler, the logged loss curve,
  and this rank's RNG streams (Python, NumPy, torch CPU/CUDA, the trainer's augmentation generator).
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

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from paratrain.checkpoint.manager import CheckpointError, find_latest_valid
from paratrain.checkpoint.state import jsonable, rng_state, set_rng_state
from paratrain.diagnose.faults import maybe_fail

if TYPE_CHECKING:
    from paratrain.train.trainer import Trainer

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class RunLifecycle:
    def __init__(self, trainer: Trainer) -> None:
        self.tr = trainer
        self.cfg = trainer.cfg
        self.ctx = trainer.ctx
        self.stopped_by: str | None = None
        self._received: int = 0
        self._flag = torch.zeros(2, dtype=torch.int32, device=self.ctx.device)  # [signal, async save failed]
        self._work: Any = None
        self._last_saved: int | None = None
        self._old_handlers: dict[int, Any] = {}

    # ---- signals ------------------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        import threading

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

    # ---- state ----------------------------------------------------------------------------------------------
    def train_state(self) -> dict[str, Any]:
        tr = self.tr
        scaler = tr.precision.scaler
        return {
            "sampler": tr.sampler.state_dict(),
            "scheduler": jsonable(tr.scheduler.state_dict()),
            "scaler": jsonable(scaler.state_dict()) if scaler is not None else None,
            "losses": list(tr.losses),
            "strategy": tr.strategy.name,
            "dp_size": tr.strategy.dp_size,
            "config": self.cfg.to_dict(),
            "num_params": tr.num_params,
        }

    def rank_state(self) -> dict[str, torch.Tensor]:
        return rng_state({"augment": self.tr._gen})

    def save(self) -> str:
        self.tr.flush_losses()  # the saved curve must reach the saved step (losses are flushed lazily)
        path = self.tr.ckpt.save(
            self.tr.step, self.tr.model, self.tr.optimizer, self.train_state(), self.rank_state()
        )
        self._last_saved = self.tr.step
        return str(path)

    # ---- the three hooks ------------------------------------------------------------------------------------
    def resume(self) -> None:
        tr, mode = self.tr, self.cfg.checkpoint.resume
        if mode == "never":
            return

        def skipped(path: Any, problems: list[str]) -> None:
            tr.log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))

        if mode == "auto":
            found = find_latest_valid(tr.ckpt.root, on_skip=skipped if self.ctx.is_main else None)
            if found is None:
                return
            path = Path(found)
        else:
            path = Path(mode)
        loaded = tr.ckpt.load(path, tr.model, tr.optimizer)
        st = loaded.train_state
        tr.step = int(st["step"])
        tr.sampler.load_state_dict(st["sampler"])
        tr.scheduler.load_state_dict(st["scheduler"])
        if st.get("scaler") is not None and tr.precision.scaler is not None:
            tr.precision.scaler.load_state_dict(st["scaler"])
        saved_bs = st.get("config", {}).get("train", {}).get("batch_size")
        tr.losses[:] = (
            [float(v) for v in st.get("losses", [])] if saved_bs == self.cfg.train.batch_size else []
        )
        if loaded.rank_state is not None:
            set_rng_state(loaded.rank_state, {"augment": tr._gen})
        else:
            # Another world size: there is no saved stream for this rank. Re-derive every stream from
            # (seed, step, rank) so the continuation is deterministic (though not bitwise equal to any
            # uninterrupted run: the random numbers are drawn from different streams).
            from paratrain.runtime import seed_everything

            seed = self.cfg.train.seed * 1_000_003 + tr.step * 7919 + self.ctx.rank
            seed_everything(seed)
            tr._gen.manual_seed(self.cfg.train.seed * 1000 + tr.strategy.dp_rank + tr.step * 7919)
        tr.resumed_from = tr.step
        self._last_saved = tr.step
        tr.log.info(
            "resumed from %s (step %d, saved with world size %s, strategy %s)",
            loaded.path,
            tr.step,
            st.get("world_size"),
            st.get("strategy"),
        )

    def after_step(self) -> bool:
        """Run after optimizer step ``tr.step``; ``True`` means stop now (a coordinated save was made)."""
        tr = self.tr
        error = tr.ckpt.poll()
        maybe_fail(tr.step, self.ctx, self.cfg.launch.fail_at_step, self.cfg.launch.fail_rank)
        sig, failed = self._agree(error is not None)
        if failed:
            from paratrain.checkpoint.async_save import AsyncCheckpointError

            raise error or AsyncCheckpointError(
                f"rank {self.ctx.rank}: a background checkpoint save failed on another rank (its log names it)"
            )
        if sig:
            self.stopped_by = signal.Signals(sig).name
            if self._last_saved != tr.step:
                self.save()
            tr.ckpt.wait()
            if self.ctx.is_main:
                print(
                    f"[paratrain] {self.stopped_by}: saved a checkpoint at step {tr.step} and stopped; "
                    "run the same command again to resume",
                    file=sys.stderr,
                    flush=True,
                )
            return True
        every = self.cfg.checkpoint.every
        if every and tr.step % every == 0 and tr.step < tr.total_steps:
            self.save()
        return False

    def finish(self, steps_run: int) -> str | None:
        """Final save (unless just saved) and wait for saves in flight; returns the last checkpoint path."""
        tr = self.tr
        if self._work is not None:
            self._work.wait()  # every rank launched the same number of flag reductions
            self._work = None
        path = None
        if self.stopped_by is None and self.cfg.checkpoint.save_at_end and steps_run > 0:
            path = self.save() if self._last_saved != tr.step else str(tr.ckpt.root / _name(tr.step))
        tr.ckpt.wait()
        tr.ckpt.close()
        if self.stopped_by is not None:
            path = str(tr.ckpt.root / _name(tr.step))
        return path


def _name(step: int) -> str:
    from paratrain.checkpoint.manager import step_dir_name

    return step_dir_name(step)


__all__ = ["CheckpointError", "RunLifecycle"]
