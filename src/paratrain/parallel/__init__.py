"""Strategy registry and ``paratrain.setup``.

A strategy is a class that registers itself under a name (``@register_strategy("ddp")``). The CLI, the
planner and the benchmarks all look names up here, so ``--strategy zero3`` means the same thing
everywhere. ``setup(model, optimizer, strategy=...)`` applies one and returns the wrapped model, the
optimizer (rebound to the new parameters when the strategy replaces them) and the strategy object, which
the Trainer asks for everything strategy-specific: gradient-sync suppression during accumulation, global
gradient-norm clipping, the data-parallel rank/size the sampler uses, and memory accounting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import ConfigError, StrategyConfig
from paratrain.runtime import Context

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
    names = list(_REGISTRY) + (list(_ALIASES) if include_aliases else [])
    return sorted(names)


def get_strategy(name: str) -> type[Strategy]:
    _load_builtin()
    name = _ALIASES.get(name, name)
    if name not in _REGISTRY:
        from paratrain.config import _suggest

        raise ConfigError(f"unknown strategy {name!r}. {_suggest(name, available_strategies())}")
    return _REGISTRY[name]


class Strategy:
    """Base class. Subclasses override :meth:`wrap` and whatever else differs from plain replication."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    supports_offload: ClassVar[bool] = False
    """Accepts ``strategy.offload`` (``--offload``)."""
    supports_mixed_precision: ClassVar[bool] = False
    """Accepts ``strategy.mixed_precision`` other than ``fp32``."""
    uses_shard_size: ClassVar[bool] = False
    """Accepts ``strategy.shard_size`` (``--shard-size``)."""

    def __init__(self, ctx: Context, config: StrategyConfig) -> None:
        self.ctx = ctx
        self.config = config

    # ---- checked in the launching process, before any worker starts ---------------------------------
    @classmethod
    def check(cls, world_size: int, config: StrategyConfig) -> None:
        """Raise :class:`ConfigError` when this strategy cannot run with ``world_size`` and ``config``."""

    @classmethod
    def data_parallel_size(cls, world_size: int, config: StrategyConfig) -> int:
        """How many ranks see different data (the global batch is split over these)."""
        return world_size

    # ---- applied in every worker ---------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        return model, optimizer

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context in which backward does not synchronise gradients (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to a global L2 norm. Replicated gradients: the local norm *is* the global norm."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    @property
    def dp_rank(self) -> int:
        return self.ctx.rank

    @property
    def dp_size(self) -> int:
        return self.ctx.world_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper."""
        return model


class Prepared(NamedTuple):
    model: nn.Module
    optimizer: Any
    strategy: Strategy


def setup(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strategy: str = "ddp",
    ctx: Context | None = None,
    config: StrategyConfig | None = None,
    **options: Any,
) -> Prepared:
    """Apply a parallel strategy to ``model`` (and rebind ``optimizer``). Returns ``(model, optimizer, strategy)``.

    ``ctx`` defaults to :func:`paratrain.init`'s view of the environment; ``options`` override fields of
    :class:`~paratrain.config.StrategyConfig` (for example ``bucket_cap_mb=50``).
    """
    from paratrain.runtime import init

    if ctx is None:
        ctx = init(seed=None)
    cfg = config or StrategyConfig()
    for key, value in options.items():
        if not hasattr(cfg, key):
            raise ConfigError(f"setup(): unknown strategy option {key!r}")
        setattr(cfg, key, value)
    cfg.name = strategy
    cls = get_strategy(strategy)
    check_strategy(cls, ctx.world_size, cfg)
    strat = cls(ctx, cfg)
    wrapped, opt = strat.wrap(model, optimizer)
    return Prepared(wrapped, opt, strat)


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
    cls.check(world_size, config)


# ---- optimizer rebinding: parameters matched by name -------------------------------------------------
def clone_optimizer(
    optimizer: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class over ``param_groups`` (each group carries its options).

    Constructor keywords are taken from ``optimizer.defaults`` where the constructor accepts them, so
    ``AdamW``, ``SGD`` and most third-party optimizers are rebuilt with the same settings.
    """
    import inspect

    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return cls(param_groups, **kwargs)


def rebind_optimizer(
    optimizer: torch.optim.Optimizer | None, names: dict[int, str], model: nn.Module
) -> torch.optim.Optimizer | None:
    """Rebuild ``optimizer`` over ``model``'s current parameters after a strategy replaced them.

    ``names`` maps ``id(old_param)`` to its name, taken *before* wrapping (:func:`parameter_names`). Each
    parameter is matched by name (wrapper prefixes ignored), so the order FSDP registers its sharded
    parameters in does not matter; every param group keeps its options (lr, weight decay, ...).
    """
    if optimizer is None:
        return None
    current = {canonical_name(n): p for n, p in model.named_parameters()}
    groups, changed = [], False
    for g in optimizer.param_groups:
        params = []
        for p in g["params"]:
            name = names.get(id(p))
            if name is None or name not in current:
                raise ValueError(
                    "the optimizer holds a parameter that is not in the model given to setup(); create the "
                    "optimizer over model.parameters() (or named groups of them)"
                )
            params.append(current[name])
            changed |= current[name] is not p
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    if not changed:
        return optimizer
    if optimizer.state:
        raise ValueError(
            "setup(): the optimizer has already stepped; its state cannot follow re-sharded parameters. "
            "Create the optimizer, call setup(), then train (or load a checkpoint after setup())."
        )
    return clone_optimizer(optimizer, groups)


def parameter_names(model: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` (wrapper prefixes removed), to hand to :func:`rebind_optimizer` after wrapping."""
    return {id(p): canonical_name(n) for n, p in model.named_parameters()}


def canonical_name(name: str) -> str:
    """Parameter name without wrapper prefixes (DDP ``module.``, compile, activation checkpointing)."""
    # Whole dotted components only: a substring replace of "module." would also cut the tail of
    # "_checkpoint_wrapped_module." (leaving "_checkpoint_wrapped_"). DDP's "module" is only ever first.
    parts = name.split(".")
    if parts and parts[0] == "module":
        parts = parts[1:]
    wrappers = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
    return ".".join(p for p in parts if p not in wrappers)


# ---- measurement helpers shared by all strategies --------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t  # DTensor -> this rank's shard


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def model_state_bytes(model: nn.Module, optimizer: Any) -> int:
    """Bytes this rank holds for parameters + gradients + optimizer state, counting only local shards.

    Storage shared by several tensors (a gradient that is a view of a DDP bucket) is counted once.
    """
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        t = _local(t)
        if t.device.type == "meta":
            return
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
        if key in seen and t.numel() > 0:
            return
        seen.add(key)
        total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        add(p.grad)
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    if inner is not None:
        for state in inner.state.values():
            for t in _tensors(state):
                add(t)
        for (
            group
        ) in inner.param_groups:  # zero2 keeps reduced gradient shards on the inner optimizer's params
            for p in group["params"]:
                add(p.grad)
    return total


def _load_builtin() -> None:
    from paratrain.parallel import ddp, dp, hsdp, single, zero  # noqa: F401  (registers)
