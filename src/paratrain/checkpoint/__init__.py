"""Checkpoints: DCP model/optimizer shards plus JSON/tensor training state, committed atomically.

The names below are imported on first use (PEP 562), so that ``paratrain ckpt --help`` and the checks of
``paratrain ckpt`` that need no torch (:mod:`paratrain.checkpoint.commands`) do not pay torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paratrain.checkpoint.manager import (
        CheckpointError,
        CheckpointManager,
        DamagedCheckpointError,
        find_latest_valid,
        is_valid_checkpoint,
        step_dir_name,
    )

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "DamagedCheckpointError",
    "find_latest_valid",
    "is_valid_checkpoint",
    "step_dir_name",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from paratrain.checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'paratrain.checkpoint' has no attribute {name!r}")
