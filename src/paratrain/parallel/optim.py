"""Optimizer rebinding after a strategy replaced the parameters, matched by name.

FSDP2 swaps each parameter for a sharded DTensor and zero1/zero2 hand the inner optimizer views of the
owned rows: an optimizer built over the user's parameters must follow. Names are the bridge, with wrapper
prefixes (DDP's ``module.``, compile's ``_orig_mod``, activation checkpointing's wrapper) removed.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn


def clone_optimizer(
    optimizer: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class over ``param_groups`` (each group carries its options).

    Constructor keywords are taken from ``optimizer.defaults`` where the constructor accepts them, so
    ``AdamW``, ``SGD`` and most third-party optimizers are rebuilt with the same settings.
    """

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
