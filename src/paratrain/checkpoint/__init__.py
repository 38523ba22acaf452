"""Checkpoints: DCP model/optimizer shards plus JSON/tensor training state, committed atomically."""

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
