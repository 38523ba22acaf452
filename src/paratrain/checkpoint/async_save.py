"""Asynchronous checkpointing with ``torch.distributed.checkpoint.async_save``.

Schedule of one async save (every rank):

- **blocking** (in ``start``): ``async_save`` stages the state dict, i.e. copies every tensor this rank
  will write into fresh CPU memory (``DefaultStager``). Only this blocks training; after it returns the
  optimizer may modify the parameters freely, the staged copy is what gets written.
- **background** (a thread owned by DCP): plan exchange, writing this rank's ``.distcp`` file(s), and the
  coordinator's ``.metadata``. Its collectives run on a dedicated Gloo group created once at start-up, so
  they can never interleave with the training collectives on the default group (torchtitan does the same).
- **commit** (in ``poll``/``wait``, on the training thread): when rank 0 sees its future done, every rank's
  data is on disk (DCP's final step gathers all write results onto the coordinator before writing
  ``.metadata``), so rank 0 commits without a further collective. Other ranks only check their future.

Errors: DCP propagates a failed write on any rank to every rank's future (the gather/broadcast carries the
exception), but ranks notice at different steps. ``poll()`` (once per step) only records the failure; the
training loop folds "my save failed" into its per-step flag all-reduce (:mod:`paratrain.checkpoint.lifecycle`),
so every rank raises :class:`AsyncCheckpointError` at the same step and none is left waiting in a
collective. ``wait()`` raises it directly. A run never ends with exit code 0 and a missing checkpoint. One
save is in flight at a time: ``start`` first waits for the previous one.

Reference: https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict_saver.async_save
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.runtime import Context


class AsyncCheckpointError(RuntimeError):
    """A background checkpoint write failed; raised on every rank."""


class AsyncSaver:
    def __init__(self, ctx: Context, commit: Callable[[Path, Path], None]) -> None:
        self.ctx = ctx
        self._commit = commit
        # A CPU group for DCP's background collectives (the default group may be NCCL, and must not be
        # used from two threads with interleaved collectives).
        self._pg = dist.new_group(backend="gloo") if ctx.distributed else None
        self._pending: tuple[Future[Any], Path, Path] | None = None
        self._failed: AsyncCheckpointError | None = None

    def start(self, state: dict[str, Any], tmp: Path, final: Path) -> None:
        """Stage ``state`` to CPU (blocking) and write it to ``tmp`` in the background."""
        if self._pending is not None:
            raise RuntimeError("an async checkpoint is already in flight; call wait() first")
        from paratrain.diagnose.faults import storage_writer_for

        fut = dcp.async_save(
            state,
            checkpoint_id=str(tmp),
            storage_writer=storage_writer_for(tmp, self.ctx.rank),
            process_group=self._pg,
            no_dist=not self.ctx.distributed,
        )
        upload = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse when a stager returns a future
        self._pending = (upload, tmp, final)  # type: ignore[assignment]

    def poll(self) -> BaseException | None:
        """Non-blocking: commit a finished save; return (and remember) the error of a failed one."""
        if self._pending is not None and self._pending[0].done():
            try:
                self._finish()
            except AsyncCheckpointError as e:
                self._failed = e
        return self._failed

    def wait(self) -> None:
        if self._pending is not None:
            self._finish()
        if self._failed is not None:
            raise self._failed

    def _finish(self) -> None:
        assert self._pending is not None
        fut, tmp, final = self._pending
        self._pending = None
        try:
            fut.result()
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise AsyncCheckpointError(
                f"rank {self.ctx.rank}: the background save of {final.name} failed: {type(e).__name__}: {e}"
            ) from e
        if self.ctx.is_main:
            self._commit(tmp, final)

    def close(self) -> None:
        """Wait for the save in flight (so its error, if any, is raised) and free the group."""
        try:
            self.wait()
        finally:
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None
