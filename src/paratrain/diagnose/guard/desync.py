"""The replica desync check lives with the trainer (``paratrain train --check-desync-every K`` uses it too);
the guard installs it into user scripts through the optimizer step hook."""

from paratrain.train.desync import DesyncError, GuardError, check_desync, compare, named_state, tensor_digest

__all__ = ["DesyncError", "GuardError", "check_desync", "compare", "named_state", "tensor_digest"]
