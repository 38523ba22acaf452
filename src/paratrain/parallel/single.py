"""``single``: one process, no communication. The reference every other strategy is held to."""

from __future__ import annotations

from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import Strategy


@register_strategy("single")
class Single(Strategy):
    """The model as it is, on one device."""
