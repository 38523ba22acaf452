"""The errors of checkpointing and the one line a failed save is reported with (shared by the synchronous
and the asynchronous save paths)."""

from __future__ import annotations

import errno
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from paratrain.checkpoint import safe

__all__ = ["DISK_FULL", "CheckpointError", "DamagedCheckpointError", "save_error", "save_failure_message"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used or saved; the message says which and why."""


class DamagedCheckpointError(CheckpointError):
    """The checkpoint's files are not what was written (corrupt, partial, tampered): ``--resume auto``
    falls back to an older one. (A checkpoint of another model is a plain :class:`CheckpointError`.)
    Raised out of a load only when no fallback is left, so no restart can help."""

    permanent = "damaged checkpoints (a restart reads the same files)"

    def __init__(self, message: str, model_touched: bool = False, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.model_touched = model_touched
        """True when the failure came after tensors were already copied into the model/optimizer."""
        self.problems = problems or [message]
        """What is wrong, without the advice for ``--resume PATH`` (what a fallback reports)."""


DISK_FULL = "No space left on device"


def save_error(message: str, cls: type[CheckpointError] = CheckpointError) -> CheckpointError:
    """The error of a failed save with ``message`` (:func:`save_failure_message`); a full disk is marked
    permanent: a restart would fill it again (:func:`paratrain.errors.permanent_reason`)."""
    err = cls(message)
    if DISK_FULL in message:
        err.permanent = "a full disk (a restart fills it again)"  # type: ignore[attr-defined]
    return err


def save_failure_message(e: BaseException, tmp: Path, step_name: str) -> str:
    """One line for a failed save: a full disk says so and names the file; other errors name their cause."""
    full = next(
        (c for c in safe.causes(e) if isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)),
        None,
    )
    if full is not None:
        return (
            f"{DISK_FULL} while writing {full.filename or tmp}; the partial checkpoint was removed. "
            "Free space or use --ckpt-dir on another disk."
        )
    oserr = safe.first_cause(e, OSError)
    if oserr is not None and oserr.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return (
            f"cannot write checkpoint {step_name}: {oserr.strerror} ({oserr.filename or tmp}); the partial "
            "checkpoint was removed. Use a writable --ckpt-dir."
        )
    root = next((c for c in safe.causes(e) if not isinstance(c, CheckpointException)), e)
    text = (str(root).strip().splitlines() or [""])[0][:300]
    return f"saving checkpoint {step_name} failed: {type(root).__name__}: {text}"
