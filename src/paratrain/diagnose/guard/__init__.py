"""``paratrain launch --guard``: runtime guardrails for an unmodified training script (docs/guard.md).

- :mod:`bootstrap`: what each worker runs: installs the guard (:mod:`hooks`), then the user's script;
- :mod:`recorder` and :mod:`record`: every Python-level collective, numbered per process group, written to a
  per-rank mapped file (and, multi-node, the c10d store);
- :mod:`analysis`: mismatched collectives and the hang post-mortem, pure functions over the records;
- :mod:`desync`: replicas compared by bit digests every K optimizer steps (:func:`check_desync`);
- :mod:`checks`: data and placement warnings carrying ``paratrain lint``'s rule ids;
- :mod:`launcher`: :func:`launch_guarded`, :class:`GuardMonitor`, the flags.

Nothing here is imported by ``import paratrain``; the modules that need torch import it themselves.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "launch_guarded": "launcher",
    "guarded_entry": "launcher",
    "GuardMonitor": "launcher",
    "add_guard_arguments": "launcher",
    "check_desync": "desync",
    "DesyncError": "desync",
    "GuardError": "desync",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(name)


__all__ = sorted(_EXPORTS)
