"""What a worker leaves behind when it fails: the agent's error file, one line on stderr, and (for a
failure no restart can fix) the launcher's no-restart record."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from typing import Any

from paratrain.errors import permanent_reason
from paratrain.runtime.process import env_int


def record_errors(fn: Any) -> Any:
    """Decorate a worker ``main``: on an exception, write the agent's error file, print one line, exit 1.

    This replaces torch's ``@record`` (which re-raises and so prints a full traceback on every rank):
    the launcher prints the first failure once, with the traceback's last frame.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            return fn(*args, **kwargs)
        except (SystemExit, KeyboardInterrupt):  # Ctrl-C is the launcher's to report, not this rank's error
            raise
        except BaseException as e:
            raised_at = time.time()
            handler = ErrorHandler()
            handler.initialize()
            path = os.environ.get("TORCHELASTIC_ERROR_FILE")
            reason = permanent_reason(e)
            if reason is not None:
                _forbid_restart(e, reason)
            if path:
                _write_error_file(path, e, raised_at)
                rank = os.environ.get("RANK", "?")
                print(f"[rank {rank}] {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            else:
                raise
            sys.exit(1)

    return wrapper


NO_RESTART_ENV = "PARATRAIN_NO_RESTART_FILE"
"""Where a worker records a failure that no restart can fix (set by ``paratrain launch``); the launcher
reads it before restarting the group and ends the job instead (:mod:`paratrain.launch.signals`)."""


def _forbid_restart(e: BaseException, reason: str) -> None:
    """Record ``e`` in the launcher's no-restart file; the first rank to fail this way keeps its record."""
    path = os.environ.get(NO_RESTART_ENV)
    if not path:
        return
    record = {"rank": env_int("RANK", 0), "message": f"{type(e).__name__}: {e}", "reason": reason}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # another rank was first, or the launcher's directory is gone
        return
    with os.fdopen(fd, "w") as fp:
        json.dump(record, fp)


def _write_error_file(path: str, e: BaseException, raised_at: float) -> None:
    """The agent's error file, in the layout torch's ``ErrorHandler.record_exception`` writes, plus the
    time the exception was caught to the microsecond (``raised_at``): torch's own ``timestamp`` is whole
    seconds, too coarse to tell which of two ranks failed first."""
    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(raised_at)),
                "raised_at": repr(raised_at),
            },
        }
    }
    try:
        with open(path, "w") as fp:
            json.dump(data, fp)
    except OSError as err:
        print(f"paratrain: could not write the error file {path}: {err}", file=sys.stderr, flush=True)
