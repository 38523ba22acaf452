"""The ``paratrain`` logger and rank-0 printing: rank 0 speaks, the other ranks only warn."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from paratrain.runtime.process import env_int

if TYPE_CHECKING:
    from paratrain.runtime.context import Context

log = logging.getLogger("paratrain")


def print0(*args: Any, ctx: Context | None = None, **kwargs: Any) -> None:
    """``print`` on rank 0 only (RANK from the environment when no context is given)."""
    rank = ctx.rank if ctx is not None else env_int("RANK", 0)
    if rank == 0:
        print(*args, **kwargs)


class _ConsoleFilter(logging.Filter):
    """The console shows rank 0's records and only the warnings and errors of the other ranks."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.WARNING


def get_logger(ctx: Context | None = None, level: int = logging.INFO) -> logging.Logger:
    """The ``paratrain`` logger. Its console handler (stderr) drops records below WARNING on ranks other
    than 0 and prefixes theirs with ``[rank r]``; a worker's rank log (:mod:`paratrain.train.logs`) keeps
    every record of its rank."""
    rank = ctx.rank if ctx is not None else env_int("RANK", 0)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name("paratrain-console")
        log.addHandler(handler)
        log.propagate = False
    for h in log.handlers:
        if h.get_name() == "paratrain-console":
            prefix = f"[rank {rank}] " if rank != 0 else ""
            h.setFormatter(logging.Formatter(prefix + "[paratrain %(levelname)s] %(message)s"))
            h.filters = [_ConsoleFilter(rank)]
    log.setLevel(level)
    return log
