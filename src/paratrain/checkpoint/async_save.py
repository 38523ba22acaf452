"""Asynchronous checkpointing with ``torch.distributed.checkpoint.async_save``.

Schedule of one async save (every rank):

- **blocking** (in ``start``): ``async_save`` stages the state dict, i.e. copies every tensor this rank
  will write into fresh CPU memory (``DefaultStager``). Only this blocks training; after it returns the
  optimizer may modify the parameters freely, the staged copy is what gets written.
- **background** (a thread owned by DCP): plan exchange, writing this rank's ``.distcp`` file(s), and the
  coordinator's ``.metadata``. Its collectives run on a dedicated Gloo group created once at start-up, so
  they can never interleave with the training collectives on the default group (torchtitan does the same).
- **commit** (in ``poll``/``wait``, on the training thread): when rank 0 sees its future done, every rank's
  data is on disk (DCP's final step gathers all write results, with every rank's checksums, onto the
  coordinator before writing ``.metadata``), so rank 0 commits without a further collective. Other ranks
  only check their future.

Errors: DCP propagates a failed write on any rank to every rank's future (the gather/broadcast carries the
exception), but ranks notice at different steps. ``poll()`` (once per step) only records the failure; the
training loop folds "my save failed" into its per-step flag all-reduce (:mod:`paratrain.checkpoint.lifecycle`),
so every rank raises :class:`AsyncCheckpointError` at the same step and none is left waiting in a
collective. A failed commit on rank 0 (a full disk while writing ``commit.json``) is reported the same way.
``wait()`` raises it directly. A run never ends with exit code 0 and a missing checkpoint. On failure rank 0
removes the temporary directory. One save is in flight at a time: ``start`` first waits for the previous one.

Reference: https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict_saver.async_save
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint.errors import CheckpointError, save_error, save_failure_message
from paratrain.checkpoint.integrity import FileDigest, HashingWriter
from paratrain.runtime import Context


class AsyncCheckpointError(CheckpointError):
    """A background checkpoint write failed; raised on every rank."""


CommitFn = Callable[[Path, Path, "dict[str, FileDigest] | None"], None]


class AsyncSaver:
    def __init__(self, ctx: Context, commit: CommitFn) -> None:
        self.ctx = ctx
        self._commit = commit
        # A CPU group for DCP's background collectives (the default group may be NCCL, and must not be
        # used from two threads with interleaved collectives).
        self._pg = dist.new_group(backend="gloo") if ctx.distributed else None
        self._pending: tuple[Future[Any], Path, Path, HashingWriter] | None = None
        self._failed: AsyncCheckpointError | None = None

    def start(self, state: dict[str, Any], tmp: Path, final: Path, writer: HashingWriter) -> None:
        """Stage ``state`` to CPU (blocking) and write it to ``tmp`` through ``writer`` in the background."""
        if self._pending is not None:
            raise RuntimeError("an async checkpoint is already in flight; call wait() first")
        try:
            fut = dcp.async_save(
                state,
                checkpoint_id=str(tmp),
                storage_writer=writer,
                process_group=self._pg,
                no_dist=not self.ctx.distributed,
            )
        except (Exception, CheckpointException) as e:  # staging failed (out of memory, ...)
            raise save_error(
                f"rank {self.ctx.rank}: staging for the background save: {save_failure_message(e, tmp, final.name)}",
                AsyncCheckpointError,
            ) from None
        upload = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse when a stager returns a future
        self._pending = (upload, tmp, final, writer)  # type: ignore[assignment]

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
        fut, tmp, final, writer = self._pending
        self._pending = None
        try:
            fut.result()
            if self.ctx.is_main:
                self._commit(tmp, final, writer.all_digests)
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise save_error(
                f"rank {self.ctx.rank}: background save: {save_failure_message(e, tmp, final.name)}",
                AsyncCheckpointError,
            ) from None

    def close(self) -> None:
        """Wait for the save in flight (so its error, if any, is raised) and free the group."""
        try:
            self.wait()
        finally:
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None
