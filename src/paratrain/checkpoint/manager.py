"""Checkpoint manager: ``DIR/step_NNNNNNNN/`` directories written by DCP, checksummed, committed atomically.

Save protocol (every rank takes part; ``async`` differences in brackets):

1. rank 0 creates ``DIR/.step_NNNNNNNN.tmp-<job>/`` (a name unique to the job, so two jobs never share a
   temporary name; a leftover of this job's crashed save is removed) and broadcasts its name, or its error,
   so every rank fails together on a full or read-only disk;
2. each rank serializes its RNG states (``rng/rank_NNNNN.pt``, tensors only) and rank 0 the training state
   (``train_state.json``) to memory, hashes the bytes and writes them; an error here is handed to the
   rank's storage writer, which raises it inside DCP's write step, so again every rank fails together;
3. ``torch.distributed.checkpoint.save`` writes the model and optimizer state dicts through
   :class:`~paratrain.checkpoint.integrity.HashingWriter`: each rank writes (and hashes, in the same pass)
   its own shards in parallel; the coordinator gathers every rank's write results, which carry that rank's
   ``{file: (size, checksum)}``, and writes (and hashes) ``.metadata`` last. So when the save returns on
   rank 0, every rank's files are on disk and rank 0 holds every checksum.
   [async: ``dcp.async_save`` copies the state dicts to CPU (the only part that blocks training) and writes
   in a background thread, on a separate Gloo group so its collectives never interleave with training's];
4. rank 0 commits: writes ``commit.json`` (size and checksum of every file), renames the temporary directory
   to its final name, fsyncs ``DIR``, replaces ``DIR/latest`` atomically (through ``latest.tmp-<job>-<pid>``),
   applies retention, and broadcasts the outcome (the barrier every rank waits in).
   [async: rank 0 commits when it sees its future done, polled once per step; a failed background write or
   commit is agreed on by all ranks through the per-step flag reduction and raised on every rank at one step.]
On any failure the temporary directory is removed; a full disk is reported as such, naming the file.

Loading (:meth:`CheckpointManager.load`) first verifies the checkpoint (:func:`~paratrain.checkpoint.layout.check_checkpoint`)
with the hashing split among the ranks and the answers combined, so all ranks agree; then it reads this
rank's RNG state and the training state (validated), and only then lets DCP read tensors. Nothing is
unpickled (:mod:`paratrain.checkpoint.safe`). Any damage is one :class:`DamagedCheckpointError` naming the
file, on every rank; :meth:`CheckpointManager.load_latest_valid` falls back to an older checkpoint instead.

The manager runs the protocol; the commit, ``latest``, ``best`` and retention are
:mod:`paratrain.checkpoint.commit`, reading back is :mod:`paratrain.checkpoint.load`.

Reference: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint.collective import agree, broadcast_object
from paratrain.checkpoint.commit import BEST_FILE, commit, committed_since, read_best, retain, write_best
from paratrain.checkpoint.errors import (
    CheckpointError,
    DamagedCheckpointError,
    save_error,
    save_failure_message,
)
from paratrain.checkpoint.integrity import (
    COMMIT_FILE,
    FileDigest,
    HashingWriter,
    default_algorithm,
    new_hasher,
)
from paratrain.checkpoint.layout import (
    SkipFn,
    candidates,
    check_checkpoint,
    compare_state,
    find_latest_valid,
    is_valid_checkpoint,
    list_checkpoints,
    mismatch_message,
    model_shapes,
    read_latest,
    step_dir_name,
    step_of,
)
from paratrain.checkpoint.load import (
    Loaded,
    StateFns,
    default_state_fns,
    load_state_dicts,
    read_states,
    single_process_quiet,
)
from paratrain.checkpoint.state import FORMAT_VERSION, TRAIN_STATE_FILE, save_rank_state, write_train_state
from paratrain.runtime import Context

WriterFactory = Callable[..., HashingWriter]
"""Called like :class:`HashingWriter` (``path, rank=, extra=, algorithm=``); a subclass of it is one."""

__all__ = [
    "BEST_FILE",
    "COMMIT_FILE",
    "CheckpointError",
    "CheckpointManager",
    "DamagedCheckpointError",
    "Loaded",
    "broadcast_object",
    "check_checkpoint",
    "committed_since",
    "compare_state",
    "find_latest_valid",
    "is_valid_checkpoint",
    "list_checkpoints",
    "mismatch_message",
    "model_shapes",
    "read_best",
    "read_latest",
    "step_dir_name",
    "step_of",
]

SHARED_ROOT_WAIT_S = 5.0
"""How long a rank looks for rank 0's probe file before it calls the checkpoint directory unshared."""


def default_job_id() -> str:
    """``PARATRAIN_JOB_ID`` (the launcher sets it to the id it locked the directory with), else ``host-pid``
    of this process: unique among live processes. (Not torchrun's run id: it is ``none`` by default.)"""
    return os.environ.get("PARATRAIN_JOB_ID") or f"{socket.gethostname()}-{os.getpid()}"


class CheckpointManager:
    """Saves and loads ``DIR/step_NNNNNNNN`` checkpoints for one run; every rank constructs one (collective:
    the ranks check that they all see ``DIR``).

    ``state_fns`` is ``(get(model, optim) -> (model_sd, optim_sd), set(model, optim, model_sd, optim_sd))``;
    the default is DCP's ``get_state_dict``/``set_state_dict``, which yield FQN-keyed (and, for sharded
    strategies, DTensor) state that DCP reshards across world sizes and strategies. ``job_id`` makes the
    temporary names unique (default :func:`default_job_id`, rank 0's counts); ``writer_factory`` replaces
    the storage writer (fault injection: a :class:`HashingWriter` subclass); ``check_shared=False`` skips
    the check that every rank sees ``DIR`` (for a run that neither saves nor resumes).
    """

    def __init__(
        self,
        root: str | Path,
        ctx: Context,
        keep_last: int | None = None,
        async_save: bool = False,
        state_fns: StateFns | None = None,
        *,
        job_id: str | None = None,
        writer_factory: WriterFactory | None = None,
        checksum_algorithm: str | None = None,
        check_shared: bool = True,
    ) -> None:
        self.root = Path(root)
        self.ctx = ctx
        self.keep_last = keep_last
        self._fns = state_fns or default_state_fns()
        self._custom_state_fns = state_fns is not None
        self.job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id or default_job_id())[:64]
        self.writer_factory: WriterFactory = writer_factory or HashingWriter
        if checksum_algorithm is not None:
            new_hasher(checksum_algorithm)  # an unknown or unavailable algorithm fails here, not at a save
        self.checksum_algorithm = checksum_algorithm or default_algorithm()
        """Rank 0's choice is used by every rank (sent with the temporary directory's name)."""
        self.blocked_s: list[float] = []
        """Seconds training was blocked by each save (sync: the whole save; async: staging only)."""
        self._verified: set[tuple[str, int, int, int]] = set()
        if check_shared and ctx.distributed and ctx.world_size > 1:
            self._check_shared_root()
        self._async = None
        if async_save:
            from paratrain.checkpoint.async_save import AsyncSaver

            self._async = AsyncSaver(ctx, self._commit)

    def _check_shared_root(self) -> None:
        """Collective: every rank must see the directory rank 0 commits checkpoints in. A run over several
        nodes whose ``--run-dir`` is on each node's own disk (or a relative path from different working
        directories) fails here, at start, instead of at its first save after the training it would lose:
        rank 0 writes a probe file, every rank looks for it (for up to ``SHARED_ROOT_WAIT_S``, for network file
        systems), and all of them raise naming the ranks, hosts and paths that do not see it. An unwritable
        directory is left to the first save to report, as before."""
        name = None
        if self.ctx.is_main:
            probe = self.root / f".shared-probe-{self.job_id}"  # rank 0's job id names it
            with contextlib.suppress(OSError):
                self.root.mkdir(parents=True, exist_ok=True)
                probe.write_text(f"{socket.gethostname()} {os.getpid()}\n")
                name = probe.name
        name = broadcast_object(name, self.ctx)
        if name is None:
            return
        probe = self.root / name
        deadline = time.monotonic() + SHARED_ROOT_WAIT_S
        while not (seen := probe.is_file()) and time.monotonic() < deadline:
            time.sleep(0.1)
        mine = (seen, socket.gethostname(), str(self.root.absolute()))
        everyone: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(everyone, mine)
        if self.ctx.is_main:
            probe.unlink(missing_ok=True)
        blind = [f"rank {r} on {host} ({path})" for r, (ok, host, path) in enumerate(everyone) if not ok]
        if blind:
            raise CheckpointError(
                f"the checkpoint directory is not shared: rank 0 on {everyone[0][1]} writes checkpoints to "
                f"{everyone[0][2]}, and {', '.join(blind)} cannot see what it writes there. A run over several "
                "nodes needs --run-dir (or checkpoint.dir) on storage every node mounts at the same path "
                "(NFS, Lustre, ...), given as an absolute path."
            )

    # ---- save ---------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Any,
        train_state: dict[str, Any],
        rank_state: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """Save step ``step``; returns the final path (committed on return unless saving asynchronously).

        Raises :class:`CheckpointError` on every rank when any rank fails (the temporary directory removed).
        """
        t0 = time.perf_counter()
        if self._async is not None:
            self._async.wait()  # one save in flight: the previous one must be committed first
        final = self.root / step_dir_name(step)
        tmp, algorithm = self._make_tmp(final)
        writer = self.writer_factory(tmp, rank=self.ctx.rank, algorithm=algorithm)
        if not isinstance(writer, HashingWriter):
            raise TypeError("writer_factory must return a paratrain.checkpoint.integrity.HashingWriter")
        try:
            rel, digest = save_rank_state(tmp, self.ctx.rank, rank_state or {}, algorithm)
            writer.extra[rel] = digest
            if self.ctx.is_main:
                state = dict(train_state, step=step, world_size=self.ctx.world_size, format=FORMAT_VERSION)
                writer.extra[TRAIN_STATE_FILE] = write_train_state(tmp, state, algorithm)
        except Exception as e:  # raised inside DCP's write step instead, where every rank learns of it
            writer.pending_error = e
        model_sd, optim_sd = self._fns[0](model, optimizer)
        if self._async is not None:
            self._async.start({"model": model_sd, "optim": optim_sd}, tmp, final, writer)
            self.blocked_s.append(time.perf_counter() - t0)
            return final
        try:
            with single_process_quiet():
                dcp.save(
                    {"model": model_sd, "optim": optim_sd},
                    storage_writer=writer,
                    no_dist=not self.ctx.distributed,
                )
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise save_error(save_failure_message(e, tmp, final.name)) from None
        error = None
        if self.ctx.is_main:
            try:
                self._commit(tmp, final, writer.all_digests)
            except Exception as e:
                shutil.rmtree(tmp, ignore_errors=True)
                error = save_failure_message(e, tmp, final.name)
        error = broadcast_object(error, self.ctx)  # every rank waits here for the commit, and shares its fate
        if error is not None:
            raise save_error(error)
        self.blocked_s.append(time.perf_counter() - t0)
        return final

    def _make_tmp(self, final: Path) -> tuple[Path, str]:
        """Rank 0 creates the temporary directory; every rank learns its name and the checksum algorithm,
        or rank 0's error (one broadcast: what the barrier before the writes used to be)."""
        name, error = None, None
        if self.ctx.is_main:
            tmp = self.root / f".{final.name}.tmp-{self.job_id}"
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # left over by a crashed save of this job: never committed, never loaded
                    shutil.rmtree(tmp)
                tmp.mkdir()
                name = tmp.name
            except OSError as e:
                error = save_failure_message(e, tmp, final.name)
        name, error, algorithm = broadcast_object((name, error, self.checksum_algorithm), self.ctx)
        if error is not None:
            raise save_error(error)
        return self.root / name, algorithm

    def poll(self) -> BaseException | None:
        """Async: commit a finished background save; return the error of a failed one (does not raise)."""
        return self._async.poll() if self._async is not None else None

    def wait(self) -> None:
        """Block until no save is in flight (committed, or its error raised)."""
        if self._async is not None:
            self._async.wait()
            self.ctx.barrier()

    def close(self) -> None:
        if self._async is not None:
            self._async.close()

    def _commit(self, tmp: Path, final: Path, digests: dict[str, FileDigest] | None) -> None:
        """Rank 0 only, after every rank's files are written: manifest, rename, ``latest``, retention."""
        commit(self.root, tmp, final, digests, self.checksum_algorithm, self.job_id)
        retain(self.root, self.keep_last, final)

    def mark_best(self, step: int, eval_loss: float) -> None:
        """Rank 0: ``DIR/best`` names the committed checkpoint of ``step`` (first line) and its eval loss
        (second line); replaced atomically. Retention never deletes the checkpoint it names."""
        if self.ctx.is_main:
            write_best(self.root, step, eval_loss, f"{self.job_id}-{os.getpid()}")
            retain(self.root, self.keep_last, self.root / step_dir_name(step))  # the previous best may go now

    # ---- verify and load --------------------------------------------------------------------------------------
    def _key(self, p: Path) -> tuple[str, int, int, int] | None:
        try:
            st = (p / COMMIT_FILE).stat()
        except OSError:
            return None
        return (str(p.resolve()), st.st_ino, st.st_mtime_ns, st.st_size)

    def _local_check(self, p: Path) -> list[str]:
        if self._key(p) in self._verified:
            return []
        share_of = (self.ctx.rank, self.ctx.world_size) if self.ctx.distributed else None
        return check_checkpoint(p, verify=True, share_of=share_of)

    def verify(self, path: str | Path) -> list[str]:
        """Collective: every reason ``path`` is not usable, checksums included, agreed by all ranks. Each
        rank hashes about ``1/world_size`` of the bytes; a success is remembered until ``commit.json`` changes."""
        p = Path(path)
        problems = agree(self._local_check(p), self.ctx)
        key = self._key(p)
        if not problems and key is not None:
            self._verified.add(key)
        return problems

    def find_latest_valid(self, on_skip: SkipFn | None = None) -> Path | None:
        """Collective :func:`find_latest_valid` over :attr:`root`, with the checksum reading split among ranks."""
        for p in candidates(self.root, on_skip):
            problems = self.verify(p)
            if not problems:
                return p
            if on_skip is not None:
                on_skip(p, problems)
        return None

    def load(self, path: str | Path, model: nn.Module, optimizer: Any) -> Loaded:
        """Verify ``path`` (checksums included) and check it against ``model``, then load model, optimizer
        and this rank's saved tensors. Collective; raises the same error on every rank."""
        p = Path(path)
        local = self._local_check(p)
        state: dict[str, Any] = {}
        rank_state = None
        if not local:
            local, state, rank_state = read_states(p, self.ctx)
        problems = agree(local, self.ctx)
        if problems:
            raise DamagedCheckpointError(
                f"checkpoint {p} is not usable: {'; '.join(problems)}. Point --resume at another step "
                "directory, or use --resume auto to fall back to the newest valid one.",
                problems=problems,
            )
        key = self._key(p)
        if key is not None:
            self._verified.add(key)
        fns = self._fns
        if not self._custom_state_fns and int(state.get("format", FORMAT_VERSION)) < 2:
            fns = default_state_fns(flatten=False)  # format 1: optimizer state saved nested
        load_state_dicts(p, model, optimizer, fns, self.ctx)
        return Loaded(p, state, rank_state)

    def load_latest_valid(
        self, model: nn.Module, optimizer: Any, on_skip: SkipFn | None = None, since: float | None = None
    ) -> Loaded | None:
        """Collective ``--resume auto``: load the newest checkpoint that verifies *and* loads, reporting every
        one passed over through ``on_skip``; ``None`` when there is none (start fresh). Raises when every
        candidate failed after one had already been partly read into the model (a fresh start is then
        impossible). ``since`` (the same on every rank): only checkpoints committed at or after this time
        (``commit.json``'s ``committed_at``) are candidates: a restarted job's own."""
        touched = None
        for p in candidates(self.root, on_skip):
            if since is not None and not committed_since(p, since):
                continue
            problems = self.verify(p)
            if not problems:
                try:
                    return self.load(p, model, optimizer)
                except DamagedCheckpointError as e:
                    touched = p if e.model_touched else touched
                    problems = e.problems  # (already under --resume auto: no advice to use it)
            if on_skip is not None:
                on_skip(p, problems)
        if touched is not None:
            raise DamagedCheckpointError(
                f"no usable checkpoint in {self.root}: {touched.name} failed while loading, after the model "
                "was partly overwritten, and no older one loads. Use --resume never to start fresh."
            )
        return None
