"""``single``: one process, no communication. The reference every other strategy is held to."""

from __future__ import annotations

from paratrain.parallel import Strategy, register_strategy


@register_strategy("single")
class Single(Strategy):
    description = "one process, no communication (the reference)"
