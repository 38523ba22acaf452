"""The bottom of the import graph: the one user-facing error type and the one "did you mean" helper.

Every layer raises :class:`ConfigError` for bad input (a flag, a config value, a dataset path, a world size
that does not divide) so that the CLI can print one message and exit 2 before any process starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A bad input. The message names what is wrong and how to fix it."""


def suggest(name: str, choices: Iterable[str]) -> str:
    """``"Choose one of: a, b, c. Did you mean 'b'?"`` for an unknown ``name``."""
    options = sorted(set(choices))
    close = difflib.get_close_matches(name, options, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Choose one of: {', '.join(options)}.{hint}"


__all__ = ["ConfigError", "suggest"]
