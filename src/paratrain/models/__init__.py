"""Model registry. Every model exposes ``blocks`` (an ``nn.ModuleList``): the units that sharded strategies
wrap one by one and that activation checkpointing recomputes."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from paratrain.config import ConfigError, ModelConfig

ModelBuilder = Callable[[ModelConfig, tuple[int, ...], int], nn.Module]
_REGISTRY: dict[str, ModelBuilder] = {}


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    def deco(fn: ModelBuilder) -> ModelBuilder:
        _REGISTRY[name] = fn
        return fn

    return deco


def available_models() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def build_model(cfg: ModelConfig, input_shape: tuple[int, ...], num_outputs: int) -> nn.Module:
    """Build ``cfg.name`` for inputs of ``input_shape`` (without the batch dim) and ``num_outputs`` logits."""
    _load_builtin()
    if cfg.name not in _REGISTRY:
        raise ConfigError(f"unknown model {cfg.name!r}. Choose one of: {', '.join(available_models())}.")
    return _REGISTRY[cfg.name](cfg, input_shape, num_outputs)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _load_builtin() -> None:
    from paratrain.models import cnn, mlp, resnet  # noqa: F401  (registers)
