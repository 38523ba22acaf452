"""The commit of a saved checkpoint and what follows it: ``commit.json``, the rename, ``latest``, ``best``,
retention. Rank 0 only; every function here is plain file-system work, no collective.

A checkpoint is valid only once committed: its files are written under a temporary name, checked against
the checksums every rank's writer returned, described in ``commit.json``, and then renamed to
``step_NNNNNNNN`` (the commit); ``DIR/latest`` is replaced atomically after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from paratrain.checkpoint.errors import CheckpointError
from paratrain.checkpoint.integrity import COMMIT_FILE, FileDigest, manifest_json, write_file_hashed
from paratrain.checkpoint.layout import (
    LATEST_FILE,
    by_commit_order,
    committed_at,
    is_valid_checkpoint,
    list_checkpoints,
    step_dir_name,
)

BEST_FILE = "best"
"""``DIR/best``: the checkpoint with the lowest eval loss so far (``--keep-best``)."""


def commit(
    root: Path, tmp: Path, final: Path, digests: dict[str, FileDigest] | None, algorithm: str, job_id: str
) -> None:
    """After every rank's files are written: check them against ``digests``, write the manifest, rename
    ``tmp`` to ``final``, and point ``latest`` at it. A step saved again replaces the old directory."""
    if digests is None:
        raise CheckpointError("the storage writer returned no checksums (it must be a HashingWriter)")
    on_disk = {f.relative_to(tmp).as_posix(): f.stat().st_size for f in tmp.rglob("*") if f.is_file()}
    unhashed = sorted(set(on_disk) ^ set(digests))
    if unhashed:
        raise CheckpointError(f"{', '.join(unhashed)}: on disk without a checksum, or the reverse")
    for rel, d in digests.items():
        if on_disk[rel] != d.size:
            raise CheckpointError(f"{rel} has {on_disk[rel]} bytes on disk, {d.size} were written")
    manifest = manifest_json(digests, algorithm, time.time())
    write_file_hashed(tmp / COMMIT_FILE, _json_bytes(manifest), "crc32")  # its checksum is not recorded
    old = None
    if final.exists():  # the same step saved again (e.g. after a restart): swap, then drop the old one
        old = root / f".{final.name}.old-{job_id}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)  # the commit
    _fsync_dir(root)
    write_text_atomic(root / LATEST_FILE, final.name + "\n", f"{job_id}-{os.getpid()}")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def retain(root: Path, keep_last: int | None, newest: Path) -> None:
    """Keep the newest ``keep_last`` valid checkpoints (by commit time). Never touches ``newest``, the one
    ``best`` names, or a temporary directory (a save in flight is never a ``step_*`` name). Validity here is
    the cheap check (sizes, manifest, state), not the checksums: retention must not read every checkpoint."""
    if keep_last is None:
        return
    # newest by commit time, not by step: a --resume never run or a rollback saves low steps next to an
    # earlier run's higher ones, and must keep its own checkpoints, not the other run's
    valid = by_commit_order(p for p in list_checkpoints(root) if is_valid_checkpoint(p, verify=False))
    best = read_best(root)  # --keep-best: the best evaluated checkpoint stays
    for p in valid[: max(0, len(valid) - keep_last)]:
        if p != newest and p.name != best:
            shutil.rmtree(p, ignore_errors=True)


def write_best(root: Path, step: int, eval_loss: float, tag: str) -> None:
    """``DIR/best`` names the checkpoint of ``step`` (first line) and its eval loss (second line)."""
    write_text_atomic(root / BEST_FILE, f"{step_dir_name(step)}\n{eval_loss!r}\n", tag)


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


def write_text_atomic(path: Path, text: str, tag: str) -> None:
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


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=True).encode()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
