"""The names ``--model`` accepts: each built-in family registers its builder here (:func:`register_model`).

A family module imports this registry; the registry imports no family (:mod:`paratrain.models` loads them),
so the entries never import back the package that collects them.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from paratrain.config import ModelConfig

ModelBuilder = Callable[[ModelConfig, tuple[int, ...], int], nn.Module]
"""``(model config, one sample's shape, outputs) -> model``."""
REGISTRY: dict[str, ModelBuilder] = {}
"""Builder per model name."""


def register_model(name: str) -> Callable[[ModelBuilder], ModelBuilder]:
    """Register the decorated builder as ``--model name``."""

    def deco(fn: ModelBuilder) -> ModelBuilder:
        REGISTRY[name] = fn
        return fn

    return deco
