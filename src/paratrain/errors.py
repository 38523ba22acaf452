"""The bottom of the import graph: the one user-facing error type and the one "did you mean" helper.

Every layer raises :class:`ConfigError` for bad input (a flag, a config value, a dataset path, a world size
that does not divide) so that the CLI can print one message and exit 2 before any process starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A bad input. The message names what is wrong and how to fix it."""

    permanent = "a refused configuration"
    """Why a restart cannot help (see :func:`permanent_reason`)."""


def permanent_reason(e: BaseException) -> str | None:
    """Why restarting the job cannot change the failure ``e``, or ``None`` when a restart may help.

    An exception (or one it was raised from) says so with a ``permanent`` attribute naming the cause: a
    refused configuration, non-finite values, a full disk, damaged checkpoints. A worker that raises one
    ends the job at once instead of being restarted identically ``--max-restarts`` times
    (:func:`paratrain.runtime.record_errors`)."""
    seen: BaseException | None = e
    for _ in range(16):
        if seen is None:
            return None
        reason = getattr(seen, "permanent", None)
        if isinstance(reason, str) and reason:
            return reason
        seen = seen.__cause__
    return None


def suggest(name: str, choices: Iterable[str]) -> str:
    """``"Choose one of: a, b, c. Did you mean 'b'?"`` for an unknown ``name``."""
    options = sorted(set(choices))
    close = difflib.get_close_matches(name, options, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Choose one of: {', '.join(options)}.{hint}"


__all__ = ["ConfigError", "permanent_reason", "suggest"]
