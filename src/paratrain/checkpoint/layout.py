"""What a checkpoint directory looks like, and whether a step directory is a usable checkpoint.

``DIR/step_NNNNNNNN/`` (committed: final name, ``commit.json`` present), ``DIR/latest`` (a text file naming
the newest committed step directory). Everything here is pure reading, with no process group, so the
launching process, ``ckpt inspect`` and every rank can call it. :func:`check_checkpoint` is the one
definition of "valid":

1. a ``step_NNNNNNNN`` directory (not a symbolic link) with a ``commit.json`` that parses as a manifest;
2. every file it lists is a regular file inside the directory, with the recorded size;
3. (``verify=True``) every file's checksum matches the one recorded when it was written;
4. ``.metadata`` unpickles with the restricted unpickler and points only inside the listed files;
5. ``train_state.json`` is a JSON object of the right types whose step is the directory's step (scheduler,
   GradScaler and config fields included);
6. (``verify=True``) every ``rng/rank_R.pt`` holds RNG tensors only, and every non-tensor entry (optimizer
   ``param_groups``) reads with ``weights_only=True``, its numeric hyper-parameters being numbers: what
   loading will read, so ``ckpt inspect`` and ``--resume auto`` agree with the workers.

Checks 1-2 and 4-5 read a few small files; checks 3 and 6 read every byte once (``ckpt inspect --fast`` and
retention skip them; loading and ``--resume auto`` never do).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint import safe
from paratrain.checkpoint.integrity import (
    COMMIT_FILE,
    Manifest,
    ManifestError,
    parse_manifest,
    share,
    verify_digests,
)
from paratrain.checkpoint.state import TRAIN_STATE_FILE, read_rank_file, read_train_state

_STEP_RE = re.compile(r"step_([0-9]{8,})")
LATEST_FILE = "latest"
SkipFn = Callable[[Path, list[str]], None]


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str | Path) -> int | None:
    m = _STEP_RE.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Final-named step directories under ``root`` (committed or not), oldest first."""
    r = Path(root)
    if not r.is_dir():
        return []
    found = [p for p in r.iterdir() if _STEP_RE.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: step_of(p) or 0)


def read_latest(root: str | Path) -> tuple[Path | None, str | None]:
    """``(step directory that DIR/latest names, None)``, or ``(None, why it is ignored)``; ``(None, None)``
    when there is no ``latest``. Only a ``step_NNNNNNNN`` name directly inside ``root`` is followed."""
    r = Path(root)
    f = r / LATEST_FILE
    if not f.is_file():
        return None, None
    try:
        raw = f.read_bytes()[:4096]
    except OSError as e:
        return None, f"cannot be read ({e.strerror}); using the newest valid step directory instead"
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return (
            None,
            "holds bytes that are not UTF-8 text; ignored, using the newest valid step directory instead",
        )
    if not _STEP_RE.fullmatch(name):
        return None, (
            f"names {name[:80]!r}, which is not a step_NNNNNNNN directory inside {r}; ignored, using the newest "
            "valid step directory instead"
        )
    return r / name, None


def read_manifest(p: Path) -> Manifest | None:
    """The parsed ``commit.json`` of step directory ``p``, or ``None`` when it is missing or malformed."""
    try:
        return _read_manifest(p)
    except ManifestError:
        return None


def _read_manifest(p: Path) -> Manifest:
    try:
        obj = json.loads((p / COMMIT_FILE).read_bytes())
    except OSError as e:
        raise ManifestError(f"cannot be read ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"is not valid JSON ({str(e)[:100]})") from None
    return parse_manifest(obj)


def check_checkpoint(
    path: str | Path, verify: bool = True, share_of: tuple[int, int] | None = None
) -> list[str]:
    """Every reason ``path`` is not a usable committed checkpoint (empty list: it is valid).

    ``verify``: also compare every file's checksum (reads the whole checkpoint). ``share_of=(rank, n)``:
    hash only this rank's share of the files (the caller combines the ranks' answers).
    """
    p = Path(path)
    if not _STEP_RE.fullmatch(p.name):
        return [f"{p.name!r} is not a step_NNNNNNNN directory name"]
    if p.is_symlink():
        return ["is a symbolic link; checkpoints are real directories inside the checkpoint directory"]
    if not p.is_dir():
        return ["does not exist"]
    if not (p / COMMIT_FILE).is_file():
        return [f"no {COMMIT_FILE}: the save never finished (partial checkpoint)"]
    try:
        manifest = _read_manifest(p)
    except ManifestError as e:
        return [f"{COMMIT_FILE} {e}"]
    problems = []
    inside = p.resolve()
    for rel, size in sorted(manifest.files.items()):
        f = p / rel
        if not f.is_file():
            problems.append(f"{rel} is missing")
        elif f.is_symlink() or not f.resolve().is_relative_to(inside):
            problems.append(f"{rel} is not a regular file inside the checkpoint")
        elif f.stat().st_size != size:
            problems.append(
                f"{rel} has {f.stat().st_size} bytes, {size} were written (truncated or modified)"
            )
    if TRAIN_STATE_FILE not in manifest.files:
        problems.append(f"{COMMIT_FILE} does not list {TRAIN_STATE_FILE}")
    if problems:
        return problems
    only = None if share_of is None else share(manifest.files, *share_of)
    if verify:
        problems = verify_digests(p, manifest, only)
        if problems:
            return problems
    try:
        md = safe.read_metadata(p)
    except Exception as e:
        return [f".metadata is unreadable: {safe.describe_read_error(e)}"]
    if verify:  # what loading reads with weights_only=True: the RNG files and the optimizer's plain values
        mine = set(manifest.files if only is None else only)
        for rel in sorted(r for r in mine if r.startswith("rng/")):
            try:
                read_rank_file(p, rel)
            except safe.DamagedFileError as e:
                problems.append(str(e))
        problems.extend(safe.check_byte_entries(p, md, mine))
    try:
        for idx, info in (md.storage_data or {}).items():
            rel = str(info.relative_path)
            if manifest.files.get(rel, -1) < int(info.offset) + int(info.length):
                problems.append(f"{idx.fqn} points past the end of {rel}")
                break
    except (AttributeError, TypeError, ValueError) as e:
        problems.append(f".metadata has a malformed storage table ({type(e).__name__})")
    try:
        read_train_state(p, step_of(p))
    except safe.DamagedFileError as e:
        problems.append(str(e))
    return problems


def is_valid_checkpoint(path: str | Path, verify: bool = True) -> bool:
    return not check_checkpoint(path, verify)


def committed_at(path: str | Path) -> float | None:
    """When the checkpoint at ``path`` was committed (``commit.json``'s ``committed_at``, seconds since the
    epoch); ``None`` when there is no readable, finite value (a damaged or pre-timestamp manifest)."""
    try:
        at = json.loads((Path(path) / COMMIT_FILE).read_bytes()).get("committed_at")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        return None
    return float(at)


def _commit_time(p: Path) -> float | None:
    """``committed_at``; else the time ``commit.json`` was written (a manifest from before timestamps), else
    the directory's (a partial or damaged one); ``None`` when none can be read."""
    at = committed_at(p)
    for f in (p / COMMIT_FILE, p):
        if at is None:
            with contextlib.suppress(OSError):
                at = f.stat().st_mtime
    return at


def by_commit_order(paths: Iterable[Path]) -> list[Path]:
    """``paths`` oldest first by commit time (:func:`_commit_time`); the step number breaks ties, and one
    whose time cannot be read at all counts as the oldest. Step numbers alone are no order: a
    ``--resume never`` run or a rollback writes low steps next to an earlier run's higher ones."""

    def key(p: Path) -> tuple[bool, float, int]:
        at = _commit_time(p)
        return (at is not None, at or 0.0, step_of(p) or 0)

    return sorted(paths, key=key)


def candidates(root: str | Path, on_skip: SkipFn | None = None) -> Iterator[Path]:
    """Step directories to try for ``--resume auto``, best first: the one ``latest`` names, then the others
    newest first *by commit time*, none committed after the one ``latest`` names (a fallback never moves
    forward, e.g. onto an earlier run's higher steps). Its commit time is its ``committed_at``, or, when
    that is unreadable, the time ``latest`` was written (it is replaced right after each commit). A
    ``latest`` that cannot be followed is reported through ``on_skip(DIR/latest, [why])``, a checkpoint
    committed after it through ``on_skip(path, [why])``."""
    r = Path(root)
    named, why = read_latest(r)
    if why is not None and on_skip is not None:
        on_skip(r / LATEST_FILE, [why])
    bound = None
    if named is not None:
        instead = "ignored, using the newest valid step directory instead"
        if named.is_symlink():
            if on_skip is not None:
                on_skip(
                    named,
                    [
                        f"is a symbolic link ({LATEST_FILE} names it); checkpoints are real directories inside "
                        f"the checkpoint directory: {instead}"
                    ],
                )
        elif not named.is_dir():
            if on_skip is not None:
                what = "does not exist" if not named.exists() else "is not a directory"
                on_skip(r / LATEST_FILE, [f"names {named.name}, which {what}; {instead}"])
        else:
            yield named
            bound = committed_at(named)  # (never read through a symbolic link)
        if bound is None:
            with contextlib.suppress(OSError):
                bound = (r / LATEST_FILE).stat().st_mtime
    for p in reversed(by_commit_order(list_checkpoints(r))):
        if p == named:
            continue
        at = committed_at(p)
        if bound is not None and at is not None and at > bound:
            if on_skip is not None:
                assert named is not None
                on_skip(
                    p,
                    [
                        f"committed after {named.name}, which {LATEST_FILE} names (another run's checkpoint, "
                        f"or a newer save {LATEST_FILE} never recorded); not a fallback for it. Resume it with "
                        "--resume PATH if it is the one you want"
                    ],
                )
            continue
        yield p


def find_latest_valid(root: str | Path, on_skip: SkipFn | None = None, verify: bool = True) -> Path | None:
    """The checkpoint ``--resume auto`` loads: ``latest`` when valid, else the newest valid step directory
    committed before it (:func:`candidates`).

    ``on_skip(path, problems)`` is called for every invalid checkpoint passed over (corrupt, partial) and for
    a ``latest`` that is ignored. In one process this hashes whole checkpoints until one is valid; in a
    job, :meth:`CheckpointManager.find_latest_valid` splits that reading among the ranks.
    """
    for p in candidates(root, on_skip):
        problems = check_checkpoint(p, verify)
        if not problems:
            return p
        if on_skip is not None:
            on_skip(p, problems)
    return None


# ---- model compatibility --------------------------------------------------------------------------------------
def compare_state(
    md: Any, expected: dict[str, torch.Size], prefix: str = "model", known: set[str] | None = None
) -> list[str]:
    """Mismatches between a checkpoint's ``prefix.*`` tensors and ``expected`` {name: global shape} (this
    rank's). ``known``: every name any rank of the run holds (a pipeline stage holds a subset); a saved
    tensor outside it is "unexpected". Default: ``expected``."""
    known = set(expected) if known is None else known
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
        if name not in known:
            size = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else ""
            out.append(f"unexpected in checkpoint (not in the model): {name} {size}".rstrip())
    for name, shape in expected.items():  # an MoE model with another number of experts: say so first
        meta = saved.get(name)
        if name.endswith("expert_bias") and isinstance(meta, TensorStorageMetadata) and meta.size != shape:
            out.insert(0, f"the checkpoint has {meta.size[0]} experts per MoE layer, the model {shape[0]} "
                          "(model.n_experts): resume with the same --set model.n_experts")  # fmt: skip
            break
    return out


def model_shapes(model_sd: dict[str, Any]) -> dict[str, torch.Size]:
    return {k: v.shape for k, v in model_sd.items() if isinstance(v, torch.Tensor)}


def mismatch_message(path: Path | str, mismatches: list[str]) -> str:
    lines = "\n  ".join(mismatches)
    return (
        f"checkpoint {path} does not match this model ({len(mismatches)} mismatch(es)):\n  {lines}\n"
        "Resume with the same --model and model settings, point --ckpt-dir elsewhere, or use --resume never."
    )
