"""``single``: one process, no communication. The reference every other strategy is held to."""

from __future__ import annotations

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import Strategy
from paratrain.parallel.topology import Topology


@register_strategy("single")
class Single(Strategy):
    description = "one process, no communication (the reference)"

    @classmethod
    def check_topology(cls, topology: Topology, config: StrategyConfig) -> None:
        if topology.world_size > 1:
            raise ConfigError(
                f"strategy 'single' runs one process but the world size is {topology.world_size}. "
                "Use --nproc-per-node 1, or a data-parallel strategy such as --strategy ddp."
            )
        super().check_topology(topology, config)
