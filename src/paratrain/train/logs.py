"""A rank-aware log: every rank writes ``RUN_DIR/logs/rank{r}.log``; the console shows rank 0.

:func:`install_rank_log` is the worker's first step after ``init()``. From then on, this rank's file gets:

- every record of the ``paratrain`` logger, at INFO and above, on every rank (the console shows rank 0's,
  and only the warnings and errors of the other ranks, prefixed ``[rank r]``: :func:`paratrain.runtime.get_logger`);
- everything written to ``sys.stderr`` (Python warnings, fault-injection notices, the one line
  :func:`paratrain.runtime.record_errors` prints for an uncaught error), through a tee that also prefixes
  the other ranks' lines with ``[rank r]`` on the console;
- the traceback of an uncaught error (read back from the error file the elastic agent asked for,
  ``TORCHELASTIC_ERROR_FILE``, when the process exits), and, through :mod:`faulthandler`, the Python
  stacks of a hard crash (SIGSEGV, SIGABRT).

The file is appended to: a restarted worker group (``--max-restarts``) adds to the same file, after a
header line naming the attempt. What the tee cannot see: output of C++ code written straight to file
descriptor 2 (Gloo and NCCL's own messages); it still reaches the console.
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from paratrain.runtime import Context, get_logger


class _Tee:
    """``sys.stderr`` of a worker: the console (rank 0 unchanged, other ranks' lines prefixed) and the file."""

    def __init__(self, console: Any, file: IO[str], prefix: str) -> None:
        self.console = console
        self.file = file
        self.prefix = prefix
        self._at_line_start = True
        self._partial = ""  # the file keeps whole lines; a carriage return (progress bars) restarts the line

    def write(self, text: str) -> int:
        if self.prefix:
            out = []
            for piece in text.splitlines(keepends=True):
                if self._at_line_start and not piece.startswith("[rank "):
                    out.append(self.prefix)
                out.append(piece)
                self._at_line_start = piece.endswith("\n")
            self.console.write("".join(out))
        else:
            self.console.write(text)
        self._partial += text
        if "\n" in self._partial:
            whole, self._partial = self._partial.rsplit("\n", 1)
            self.file.write("\n".join(line.rsplit("\r", 1)[-1] for line in whole.split("\n")) + "\n")
            self.file.flush()
        self._partial = self._partial.rsplit("\r", 1)[-1]
        return len(text)

    def flush(self) -> None:
        self.console.flush()
        self.file.flush()

    def isatty(self) -> bool:
        return bool(self.console.isatty())

    def fileno(self) -> int:
        return int(self.console.fileno())

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer, ...: the console's
        return getattr(self.console, name)


def install_rank_log(ctx: Context, run_dir: str | Path) -> Path:
    """Send this rank's log lines, stderr and uncaught error to ``RUN_DIR/logs/rank{r}.log``; returns the path.

    Call it once per process, after :func:`paratrain.runtime.init`.
    """
    import logging

    path = Path(run_dir) / "logs" / f"rank{ctx.rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    log = get_logger(ctx)  # its console handler writes to the real stderr, not to the tee below
    f = open(path, "a", buffering=1)  # open as long as the process lives
    f.write(f"==== rank {ctx.rank} of {ctx.world_size}, attempt {ctx.restart_count}, pid {os.getpid()}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")  # fmt: skip
    handler = logging.StreamHandler(f)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    handler.set_name("paratrain-rank-file")
    log.addHandler(handler)
    sys.stderr = _Tee(sys.stderr, f, "" if ctx.rank == 0 else f"[rank {ctx.rank}] ")
    faulthandler.enable(file=f, all_threads=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        atexit.register(_copy_traceback, Path(error_file), f, time.time())
    return path


def _copy_traceback(error_file: Path, f: IO[str], since: float) -> None:
    """At exit: the traceback :func:`~paratrain.runtime.record_errors` left in the agent's error file."""
    try:
        if not error_file.is_file() or error_file.stat().st_mtime < since - 1:
            return
        data = json.loads(error_file.read_text())
        message = data.get("message", {})
        tb = (message.get("extraInfo") or {}).get("py_callstack", "") if isinstance(message, dict) else ""
        if tb and not f.closed:
            f.write("uncaught error, traceback:\n" + tb.rstrip("\n") + "\n")
            f.flush()
    except (OSError, ValueError, AttributeError):
        pass
