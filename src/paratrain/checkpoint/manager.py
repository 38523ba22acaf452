"""Checkpoint manager: ``DIR/step_NNNNNNNN/`` directories written by DCP and committed atomically.

Save protocol (every rank takes part; ``async`` differences in brackets):

1. rank 0 creates ``DIR/.step_NNNNNNNN.tmp/`` (removing a leftover of a crashed save); barrier;
2. each rank writes its RNG states (``rng/rank_NNNNN.pt``, tensors only); rank 0 writes
   ``train_state.json`` (step, sampler position, scheduler, scaler, logged losses, config, world size);
3. ``torch.distributed.checkpoint.save`` writes the model and optimizer state dicts: each rank writes its
   own shards in parallel (replicated tensors are written once, by one rank), the coordinator gathers
   every rank's write result and writes ``.metadata`` last. So when the save returns on rank 0, every
   rank's files are on disk (step 2 happened before each rank entered step 3).
   [async: ``dcp.async_save`` copies the state dicts to CPU (the only part that blocks training) and writes
   in a background thread, on a separate Gloo group so its collectives never interleave with training's];
4. rank 0 commits: writes ``commit.json`` (the size of every file), renames the temporary directory to its
   final name, fsyncs ``DIR``, replaces ``DIR/latest`` atomically, applies retention; barrier.
   [async: rank 0 commits when it sees its future done, polled once per step; a failed background write
   is agreed on by all ranks through the per-step flag reduction and raised on every rank at one step.]

A directory is loaded only if it is a final ``step_*`` name whose ``commit.json`` lists files that all exist
with their recorded sizes and whose ``.metadata`` only points inside them (:func:`check_checkpoint`).
Loading never unpickles arbitrary objects (:mod:`paratrain.checkpoint.safe`).

Reference: https://pytorch.org/docs/stable/distributed.checkpoint.html
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
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

from paratrain.checkpoint import safe
from paratrain.checkpoint.state import FORMAT_VERSION, load_rank_state, save_rank_state
from paratrain.diagnose.faults import storage_writer_for
from paratrain.runtime import Context

_STEP_RE = re.compile(r"^step_(\d{8,})$")
COMMIT_FILE = "commit.json"
StateFns = tuple[Callable[..., Any], Callable[..., Any]]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which and why."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str | Path) -> int | None:
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Final-named step directories under ``root`` (committed or not), oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [p for p in r.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return sorted(found, key=lambda p: step_of(p) or 0)


def check_checkpoint(path: str | Path) -> list[str]:
    """Every reason ``path`` is not a usable committed checkpoint (empty list: it is valid)."""
    p = Path(path)
    if not _STEP_RE.match(p.name):
        return [f"{p.name!r} is not a step_NNNNNNNN directory name"]
    if not p.is_dir():
        return ["does not exist"]
    commit = p / COMMIT_FILE
    if not commit.is_file():
        return [f"no {COMMIT_FILE}: the save never finished (partial checkpoint)"]
    problems = []
    try:
        files = json.loads(commit.read_text())["files"]
    except (ValueError, KeyError) as e:
        return [f"{COMMIT_FILE} is unreadable ({e})"]
    for rel, size in sorted(files.items()):
        f = p / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.stat().st_size != size:
            problems.append(
                f"{rel} has {f.stat().st_size} bytes, {size} were written (truncated or modified)"
            )
    if problems:
        return problems
    try:
        md = safe.read_metadata(p)
    except Exception as e:
        return [f".metadata is unreadable: {type(e).__name__}: {e}"]
    for idx, info in (md.storage_data or {}).items():
        rel = str(info.relative_path)
        if files.get(rel, -1) < info.offset + info.length:
            problems.append(f"{idx.fqn} points past the end of {rel}")
            break
    return problems


def is_valid_checkpoint(path: str | Path) -> bool:
    return not check_checkpoint(path)


def find_latest_valid(
    root: str | Path, on_skip: Callable[[Path, list[str]], None] | None = None
) -> Path | None:
    """The checkpoint ``--resume auto`` loads: ``latest`` when valid, else the newest valid step directory.

    ``on_skip(path, problems)`` is called for every invalid checkpoint passed over (corrupt, partial).
    """
    r = Path(root)
    seen: set[Path] = set()
    latest = r / "latest"
    if latest.is_file():
        named = r / latest.read_text().strip()
        if named.is_dir():
            problems = check_checkpoint(named)
            if not problems:
                return named
            seen.add(named)
            if on_skip is not None:
                on_skip(named, problems)
    for p in reversed(list_checkpoints(r)):
        if p in seen:
            continue
        problems = check_checkpoint(p)
        if not problems:
            return p
        if on_skip is not None:
            on_skip(p, problems)
    return None


def compare_state(md: Any, expected: dict[str, torch.Size], prefix: str = "model") -> list[str]:
    """Mismatches between a checkpoint's ``prefix.*`` tensors and ``expected`` {name: global shape}."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k[len(prefix) + 1 :]: v for k, v in md.state_dict_metadata.items() if k.startswith(prefix + ".")}
    out = []
    for name, shape in expected.items():
        if name not in saved:
            out.append(f"missing in checkpoint: {name} {tuple(shape)}")
        elif isinstance(saved[name], TensorStorageMetadata) and tuple(saved[name].size) != tuple(shape):
            out.append(
                f"shape mismatch: {name} is {tuple(saved[name].size)} in the checkpoint, {tuple(shape)} in the model"
            )
    for name, meta in saved.items():
        if name not in expected:
            size = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else ""
            out.append(f"unexpected in checkpoint (not in the model): {name} {size}".rstrip())
    return out


def model_shapes(model_sd: dict[str, Any]) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model_sd.items() if isinstance(v, torch.Tensor)}


def mismatch_message(path: Path | str, mismatches: list[str]) -> str:
    lines = "\n  ".join(mismatches)
    return (
        f"checkpoint {path} does not match this model ({len(mismatches)} mismatch(es)):\n  {lines}\n"
        "Resume with the same --model and model settings, point --ckpt-dir elsewhere, or use --resume never."
    )


@dataclass
class Loaded:
    path: Path
    train_state: dict[str, Any]
    rank_state: dict[str, torch.Tensor] | None
    """This rank's RNG/generator tensors; ``None`` when the checkpoint had no file for this rank."""


def _default_state_fns() -> StateFns:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def _set(model: nn.Module, optimizer: Any, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

    return get_state_dict, _set


class CheckpointManager:
    """Saves and loads ``DIR/step_NNNNNNNN`` checkpoints for one run; every rank constructs one.

    ``state_fns`` is ``(get(model, optim) -> (model_sd, optim_sd), set(model, optim, model_sd, optim_sd))``;
    the default is DCP's ``get_state_dict``/``set_state_dict``, which yield FQN-keyed (and, for sharded
    strategies, DTensor) state that DCP reshards across world sizes and strategies.
    """

    def __init__(
        self,
        root: str | Path,
        ctx: Context,
        keep_last: int | None = None,
        async_save: bool = False,
        state_fns: StateFns | None = None,
    ) -> None:
        self.root = Path(root)
        self.ctx = ctx
        self.keep_last = keep_last
        self._get, self._set = state_fns or _default_state_fns()
        self.blocked_s: list[float] = []
        """Seconds training was blocked by each save (sync: the whole save; async: staging only)."""
        self._async = None
        if async_save:
            from paratrain.checkpoint.async_save import AsyncSaver

            self._async = AsyncSaver(ctx, self._commit)

    # ---- save ---------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: Any,
        train_state: dict[str, Any],
        rank_state: dict[str, torch.Tensor] | None = None,
    ) -> Path:
        """Save step ``step``; returns the final path (committed on return unless saving asynchronously)."""
        t0 = time.perf_counter()
        if self._async is not None:
            self._async.wait()  # one save in flight: the previous one must be committed first
        final = self.root / step_dir_name(step)
        tmp = self.root / f".{final.name}.tmp"
        if self.ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)  # left over by a crashed save: never committed, never loaded
            tmp.mkdir()
        self.ctx.barrier()
        save_rank_state(tmp, self.ctx.rank, rank_state or {})
        if self.ctx.is_main:
            state = dict(train_state, step=step, world_size=self.ctx.world_size, format=FORMAT_VERSION)
            _write_json_atomic(tmp / "train_state.json", state)
        model_sd, optim_sd = self._get(model, optimizer)
        if self._async is not None:
            self._async.start({"model": model_sd, "optim": optim_sd}, tmp, final)
            self.blocked_s.append(time.perf_counter() - t0)
            return final
        with _single_process_quiet():
            dcp.save(
                {"model": model_sd, "optim": optim_sd},
                storage_writer=storage_writer_for(tmp, self.ctx.rank),
                no_dist=not self.ctx.distributed,
            )
        if self.ctx.is_main:
            self._commit(tmp, final)
        self.ctx.barrier()
        self.blocked_s.append(time.perf_counter() - t0)
        return final

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

    def _commit(self, tmp: Path, final: Path) -> None:
        """Rank 0 only, after every rank's files are written: manifest, rename, ``latest``, retention."""
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        _write_json_atomic(tmp / COMMIT_FILE, {"files": files, "committed_at": time.time()})
        old = None
        if final.exists():  # the same step saved again (e.g. after a restart): swap, then drop the old one
            old = self.root / f".{final.name}.old"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
        os.rename(tmp, final)  # the commit
        _fsync_dir(self.root)
        _write_text_atomic(self.root / "latest", final.name + "\n")
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self._retain(final)

    def _retain(self, newest: Path) -> None:
        """Keep the newest ``keep_last`` valid checkpoints. Never touches ``newest``, the one ``latest``
        names, or a temporary directory (a save in flight is never a ``step_*`` name)."""
        if self.keep_last is None:
            return
        valid = [p for p in list_checkpoints(self.root) if is_valid_checkpoint(p)]
        for p in valid[: max(0, len(valid) - self.keep_last)]:
            if p != newest:
                shutil.rmtree(p, ignore_errors=True)

    # ---- load ---------------------------------------------------------------------------------------------
    def load(self, path: str | Path, model: nn.Module, optimizer: Any) -> Loaded:
        """Validate ``path`` against ``model``, then load model, optimizer and this rank's saved tensors."""
        p = Path(path)
        problems = check_checkpoint(p)
        if problems:
            raise CheckpointError(
                f"{p} is not a usable checkpoint: {'; '.join(problems)}. Point --resume at another step "
                "directory, or use --resume auto to fall back to the newest valid one."
            )
        md = safe.read_metadata(p)
        state = json.loads((p / "train_state.json").read_text())
        model_sd, optim_sd = self._get(model, optimizer)
        mismatches = compare_state(md, model_shapes(model_sd))
        if mismatches:
            raise CheckpointError(mismatch_message(p, mismatches))
        to_load = {"model": model_sd, "optim": optim_sd}
        with _single_process_quiet():
            dcp.load(
                to_load,
                storage_reader=safe.SafeFileSystemReader(str(p)),
                planner=safe.SafeLoadPlanner(),
                no_dist=not self.ctx.distributed,
            )
        self._set(model, optimizer, to_load["model"], to_load["optim"])
        same_world = int(state.get("world_size", -1)) == self.ctx.world_size
        rank_state = load_rank_state(p, self.ctx.rank) if same_world else None
        return Loaded(p, state, rank_state)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns "assuming the intent is to save in a single process" at world size 1: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json_atomic(path: Path, obj: Any) -> None:
    _write_text_atomic(path, json.dumps(obj, indent=1, sort_keys=True))


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
