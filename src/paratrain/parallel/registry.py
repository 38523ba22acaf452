"""The strategy registry: every strategy registers itself under a name (``@register_strategy("ddp")``).

The names, aliases and capabilities are data in :mod:`paratrain.spec.strategies` (torch-free, read by the
CLI and the planner); this registry maps each name to the class that runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.spec import strategies as specs

if TYPE_CHECKING:
    from paratrain.parallel.strategy import Strategy

_REGISTRY: dict[str, type[Strategy]] = {}

_SPEC_ATTRS = (
    "description", "supports_offload", "supports_mixed_precision", "uses_shard_size", "shard_axis_only",
    "uses_tp", "uses_pp", "uses_fsdp", "required_axes", "comm_algorithms", "uses_ep",
)  # fmt: skip


def register_strategy(name: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Register the class that runs the spec ``name`` (:data:`paratrain.spec.strategies.STRATEGIES`); the
    spec's capabilities become the class's attributes, so they are stated once."""
    spec = specs.STRATEGIES[name]

    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        cls.spec = spec
        for attr in _SPEC_ATTRS:
            setattr(cls, attr, getattr(spec, attr))
        _REGISTRY[name] = cls
        return cls

    return deco


def available_strategies(include_aliases: bool = True) -> list[str]:
    return specs.names(include_aliases)


def strategy_aliases() -> dict[str, str]:
    """``{alias: name}`` (``fsdp`` -> ``zero3``)."""
    return dict(specs.ALIASES)


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name`` (or an alias of it); :class:`ConfigError` otherwise."""
    resolved = specs.canonical(name)
    if resolved not in _REGISTRY:
        raise ConfigError(
            f"strategy {resolved!r} has a spec but no implementation registered (import paratrain.parallel, "
            "which registers the built-in ones)."
        )
    return _REGISTRY[resolved]


def strategies_taking(algorithm: str) -> list[str]:
    """The strategies whose ``--comm-algorithm`` may be ``algorithm``, sorted."""
    return specs.strategies_taking(algorithm)


def check_strategy(
    cls: type[Strategy], world_size: int, config: StrategyConfig, gpus_per_node: int | None = None
) -> None:
    """Every refusal of the strategy's spec (options, degrees, algorithm, schedule): :meth:`Strategy.check`."""
    cls.check(world_size, config, gpus_per_node)

