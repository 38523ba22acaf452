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

Reference: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint import safe
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
    manifest_json,
    new_hasher,
    write_file_hashed,
)
from paratrain.checkpoint.layout import (
    LATEST_FILE,
    SkipFn,
    by_commit_order,
    candidates,
    check_checkpoint,
    committed_at,
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
from paratrain.checkpoint.state import (
    FORMAT_VERSION,
    TRAIN_STATE_FILE,
    load_rank_state,
    read_train_state,
    save_rank_state,
    write_train_state,
)
from paratrain.runtime import Context

StateFns = tuple[Callable[..., Any], Callable[..., Any]]
WriterFactory = Callable[..., HashingWriter]
"""Called like :class:`HashingWriter` (``path, rank=, extra=, algorithm=``); a subclass of it is one."""

__all__ = [
    "COMMIT_FILE",
    "CheckpointError",
    "CheckpointManager",
    "DamagedCheckpointError",
    "Loaded",
    "check_checkpoint",
    "compare_state",
    "find_latest_valid",
    "is_valid_checkpoint",
    "list_checkpoints",
    "mismatch_message",
    "model_shapes",
    "read_latest",
    "step_dir_name",
    "step_of",
]


@dataclass
class Loaded:
    path: Path
    train_state: dict[str, Any]
    rank_state: dict[str, torch.Tensor] | None
    """This rank's RNG/generator tensors; ``None`` when the checkpoint had no file for this rank."""


def _default_state_fns(flatten: bool = True) -> StateFns:
    """DCP's state-dict functions. ``flatten``: optimizer state keyed ``state.<fqn>.<key>`` and
    ``param_groups.<fqn>.<key>`` (format 2). Each rank then saves exactly its own parameters' entries, which a
    pipeline stage needs (the nested form keeps one rank's ``param_groups.N.params`` list, so stages holding
    different parameters could not load it). Format-1 checkpoints were saved nested."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    def _get(model: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return get_state_dict(model, optimizer, options=options)

    def _set(model: nn.Module, optimizer: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        set_state_dict(
            model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
        )

    return _get, _set


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
        self._get, self._set = state_fns or _default_state_fns()
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
        model_sd, optim_sd = self._get(model, optimizer)
        if self._async is not None:
            self._async.start({"model": model_sd, "optim": optim_sd}, tmp, final, writer)
            self.blocked_s.append(time.perf_counter() - t0)
            return final
        try:
            with _single_process_quiet():
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
        if digests is None:
            raise CheckpointError("the storage writer returned no checksums (it must be a HashingWriter)")
        on_disk = {f.relative_to(tmp).as_posix(): f.stat().st_size for f in tmp.rglob("*") if f.is_file()}
        unhashed = sorted(set(on_disk) ^ set(digests))
        if unhashed:
            raise CheckpointError(f"{', '.join(unhashed)}: on disk without a checksum, or the reverse")
        for rel, d in digests.items():
            if on_disk[rel] != d.size:
                raise CheckpointError(f"{rel} has {on_disk[rel]} bytes on disk, {d.size} were written")
        manifest = manifest_json(digests, self.checksum_algorithm, time.time())
        write_file_hashed(tmp / COMMIT_FILE, _json_bytes(manifest), "crc32")  # its checksum is not recorded
        old = None
        if final.exists():  # the same step saved again (e.g. after a restart): swap, then drop the old one
            old = self.root / f".{final.name}.old-{self.job_id}"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)  # the commit
        _fsync_dir(self.root)
        _write_text_atomic(self.root / LATEST_FILE, final.name + "\n", f"{self.job_id}-{os.getpid()}")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._retain(final)

    def _retain(self, newest: Path) -> None:
        """Keep the newest ``keep_last`` valid checkpoints (by commit time). Never touches ``newest``, the one ``latest``
        names, or a temporary directory (a save in flight is never a ``step_*`` name). Validity here is the
        cheap check (sizes, manifest, state), not the checksums: retention must not read every checkpoint."""
        if self.keep_last is None:
            return
        # newest by commit time, not by step: a --resume never run or a rollback saves low steps next to an
        # earlier run's higher ones, and must keep its own checkpoints, not the other run's
        valid = by_commit_order(
            p for p in list_checkpoints(self.root) if is_valid_checkpoint(p, verify=False)
        )
        best = read_best(self.root)  # --keep-best: the best evaluated checkpoint stays
        for p in valid[: max(0, len(valid) - self.keep_last)]:
            if p != newest and p.name != best:
                shutil.rmtree(p, ignore_errors=True)

    def mark_best(self, step: int, eval_loss: float) -> None:
        """Rank 0: ``DIR/best`` names the committed checkpoint of ``step`` (first line) and its eval loss
        (second line); replaced atomically. Retention never deletes the checkpoint it names."""
        if self.ctx.is_main:
            _write_text_atomic(self.root / BEST_FILE, f"{step_dir_name(step)}\n{eval_loss!r}\n",
                               f"{self.job_id}-{os.getpid()}")  # fmt: skip
            self._retain(self.root / step_dir_name(step))  # the previous best may go now

    # ---- verify and load --------------------------------------------------------------------------------------
    def _agree(self, local: list[str]) -> list[str]:
        """Every rank's problems, on every rank (one all-gather; world size 1: ``local``)."""
        if not self.ctx.distributed:
            return local
        gathered: list[Any] = [None] * self.ctx.world_size
        dist.all_gather_object(gathered, local)
        merged: list[str] = []
        for problems in gathered:
            merged.extend(p for p in problems or [] if p not in merged)
        return merged

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
        problems = self._agree(self._local_check(p))
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
            try:
                state = read_train_state(p, step_of(p))
                same_world = state["world_size"] == self.ctx.world_size
                rank_state = load_rank_state(p, self.ctx.rank) if same_world else None
            except safe.DamagedFileError as e:
                local = [str(e)]
        problems = self._agree(local)
        if problems:
            raise DamagedCheckpointError(
                f"checkpoint {p} is not usable: {'; '.join(problems)}. Point --resume at another step "
                "directory, or use --resume auto to fall back to the newest valid one.",
                problems=problems,
            )
        key = self._key(p)
        if key is not None:
            self._verified.add(key)
        md = safe.read_metadata(p)
        get, put = self._get, self._set
        if not self._custom_state_fns and int(state.get("format", FORMAT_VERSION)) < 2:
            get, put = _default_state_fns(flatten=False)  # format 1: optimizer state saved nested
        model_sd, optim_sd = get(model, optimizer)
        shapes = model_shapes(model_sd)
        mismatches = compare_state(md, shapes, known=self._all_names(shapes))
        if mismatches:
            raise CheckpointError(mismatch_message(p, mismatches))
        to_load = {"model": model_sd, "optim": optim_sd}
        try:
            with _single_process_quiet():
                dcp.load(
                    to_load,
                    storage_reader=safe.SafeFileSystemReader(str(p)),
                    planner=safe.SafeLoadPlanner(),
                    no_dist=not self.ctx.distributed,
                )
        except (Exception, CheckpointException) as e:  # DCP raises the same CheckpointException on all ranks
            damaged = safe.first_cause(e, safe.DamagedFileError)
            what = f"file {damaged.file}): {damaged.reason}" if damaged else f"while reading): {_one_line(e)}"
            raise DamagedCheckpointError(f"checkpoint {p} is damaged ({what}", model_touched=True) from None
        try:
            put(model, optimizer, to_load["model"], to_load["optim"])
        except Exception as e:
            raise DamagedCheckpointError(
                f"checkpoint {p} is damaged (model/optimizer state): it cannot be applied: {_one_line(e)}",
                model_touched=True,
            ) from None
        return Loaded(p, state, rank_state)

    def _all_names(self, shapes: dict[str, torch.Size]) -> set[str]:
        """Parameter names held by any rank: a pipeline stage holds only its own layers, so a tensor of
        another stage in the checkpoint is expected, not "unexpected". Collective when distributed."""
        if not (self.ctx.distributed and dist.is_initialized() and dist.get_world_size() > 1):
            return set(shapes)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(shapes))
        return {name for names in gathered for name in names}

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


BEST_FILE = "best"
"""``DIR/best``: the checkpoint with the lowest eval loss so far (``--keep-best``)."""


def read_best(root: Path) -> str | None:
    """The step directory name ``DIR/best`` names, or ``None``."""
    try:
        return (root / BEST_FILE).read_text().split("\n", 1)[0].strip() or None
    except OSError:
        return None


def committed_since(path: Path, since: float) -> bool:
    """Whether the checkpoint at ``path`` was committed at or after ``since`` (``False`` when unknown)."""
    at = committed_at(path)
    return at is not None and at >= since


# ---- errors ---------------------------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    root = next((c for c in safe.causes(e) if not isinstance(c, CheckpointException)), e)
    if isinstance(root, CheckpointException):
        return "DCP reported a failure"
    return safe.describe_read_error(root)


# ---- small helpers -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns "assuming the intent is to save in a single process" at world size 1: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _write_text_atomic(path: Path, text: str, tag: str) -> None:
    """Replace ``path`` atomically through ``NAME.tmp-TAG`` (a name no other job or process uses)."""
    tmp = path.with_name(f"{path.name}.tmp-{tag}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def broadcast_object(obj: Any, ctx: Context) -> Any:
    """Rank 0's ``obj`` on every rank (JSON-able objects only)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
