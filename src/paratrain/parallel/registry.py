"""The strategy registry: every strategy registers itself under a name (``@register_strategy("ddp")``).

The CLI, the planner and the benchmarks look names up here, so ``--strategy zero3`` means the same thing
everywhere, and an unknown name is refused here, in the launching process, with a suggestion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError, suggest

if TYPE_CHECKING:
    from paratrain.parallel.strategy import Strategy

_REGISTRY: dict[str, type[Strategy]] = {}
_ALIASES: dict[str, str] = {}


def register_strategy(name: str, aliases: tuple[str, ...] = ()) -> Callable[[type[Strategy]], type[Strategy]]:
    def deco(cls: type[Strategy]) -> type[Strategy]:
        cls.name = name
        _REGISTRY[name] = cls
        for a in aliases:
            _ALIASES[a] = name
        return cls

    return deco


def available_strategies(include_aliases: bool = True) -> list[str]:
    _load_builtin()
    return sorted(list(_REGISTRY) + (list(_ALIASES) if include_aliases else []))


def strategy_aliases() -> dict[str, str]:
    """``{alias: name}`` (``fsdp`` -> ``zero3``)."""
    _load_builtin()
    return dict(_ALIASES)


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name`` (or an alias of it); :class:`ConfigError` otherwise."""
    _load_builtin()
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        raise ConfigError(f"unknown strategy {name!r}. {suggest(name, available_strategies())}")
    return _REGISTRY[name]


def strategies_taking(algorithm: str) -> list[str]:
    """The registered strategies whose ``--comm-algorithm`` may be ``algorithm``, sorted."""
    _load_builtin()
    return sorted(n for n, c in _REGISTRY.items() if algorithm in c.comm_algorithms)


def check_strategy(cls: type[Strategy], world_size: int, config: StrategyConfig) -> None:
    """Options every strategy must refuse unless it declares support, then the strategy's own ``check``."""
    if config.offload and not cls.supports_offload:
        able = sorted(n for n, c in _REGISTRY.items() if c.supports_offload)
        raise ConfigError(
            f"--offload (strategy.offload) does not work with strategy {cls.name!r}: it keeps full model "
            f"state on the device. Strategies that can offload: {', '.join(able)}."
        )
    if config.mixed_precision != "fp32" and not cls.supports_mixed_precision:
        able = sorted(n for n, c in _REGISTRY.items() if c.supports_mixed_precision)
        raise ConfigError(
            f"strategy.mixed_precision={config.mixed_precision!r} is FSDP2's policy and needs one of "
            f"{', '.join(able)}; with {cls.name!r} use --precision bf16 (autocast) instead."
        )
    if config.shard_size is not None and not cls.uses_shard_size:
        raise ConfigError(
            f"--shard-size (strategy.shard_size) applies to hsdp only, not {cls.name!r}. "
            "Use --strategy hsdp --shard-size N, or leave --shard-size out."
        )
    _check_model_parallel_flags(cls, config)
    cls.check(world_size, config)


def _check_model_parallel_flags(cls: type[Strategy], config: StrategyConfig) -> None:
    """Tensor- and pipeline-parallel options given to a strategy without that axis are refused, not ignored.
    A value equal to the default (``--pp-schedule 1f1b``, ``--sequence-parallel``) cannot be told from an
    unset one and passes."""
    for axis, flags in (
        ("tp", [("--loss-parallel", config.loss_parallel),
                ("--no-sequence-parallel", not config.sequence_parallel)]),
        ("pp", [(f"--pp-schedule {config.pp_schedule}", config.pp_schedule != "1f1b"),
                (f"--microbatches {config.microbatches}", config.microbatches is not None)]),
    ):  # fmt: skip
        given = [flag for flag, on in flags if on]
        if given and not getattr(cls, f"uses_{axis}", False):
            able = sorted(n for n, c in _REGISTRY.items() if getattr(c, f"uses_{axis}", False))
            kind = "tensor parallelism" if axis == "tp" else "a pipeline"
            raise ConfigError(
                f"{' '.join(given)} applies to {kind}, which strategy {cls.name!r} does not have. Use a "
                f"strategy with {kind} ({', '.join(able)}), or leave {'them' if len(given) > 1 else 'it'} out."
            )


def _load_builtin() -> None:
    from paratrain.parallel import bucketed, ddp, fsdp, pipeline, single, tensor, zero  # noqa: F401  (registers)
