"""``paratrain.setup(model, optimizer, strategy=...)``: one strategy applied to a user's own model.

The run's one topology and mesh are built here (or in the worker, :func:`build_strategy`), then the
strategy replicates or shards the model and rebinds the optimizer to the parameters it ends up with.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.parallel.optim import parameter_names, rebind_optimizer
from paratrain.parallel.parallelize import materialize_deferred
from paratrain.parallel.registry import check_strategy, get_strategy
from paratrain.parallel.strategy import Strategy, has_meta_parameters, to_device
from paratrain.parallel.topology import build_mesh
from paratrain.runtime import Context


class Prepared(NamedTuple):
    model: nn.Module
    optimizer: Any
    strategy: Strategy


def build_strategy(ctx: Context, config: StrategyConfig) -> Strategy:
    """The strategy of ``config.name`` over the run's topology, with the run's one DeviceMesh.

    Collective when a mesh is needed (every rank calls it). A world of one rank with a replicating
    strategy builds no mesh and no process group: nothing is communicated.
    """
    cls = get_strategy(config.name)
    check_strategy(cls, ctx.world_size, config)
    topology = cls.topology_for(ctx.world_size, config)
    needs_mesh = cls.required_axes or (ctx.distributed and ctx.world_size > 1)
    mesh = build_mesh(topology, ctx.device.type, topology.mesh_axes(cls.required_axes)) if needs_mesh else None
    return cls(ctx, config, topology, mesh)


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
    :class:`~paratrain.config.StrategyConfig` (for example ``bucket_cap_mb=50`` or ``tp=2``), except
    ``tp_plan``: a tensor-parallel plan for a model without a built-in one (``{module name: ParallelStyle}``
    or a function ``(model, sequence_parallel, loss_parallel) -> dict``; :mod:`paratrain.parallel.tensor`).
    """
    from paratrain.runtime import init

    if ctx is None:
        ctx = init(seed=None)
    cfg = config or StrategyConfig()
    tp_plan = options.pop("tp_plan", None)
    for key, value in options.items():
        if not hasattr(cfg, key):
            raise ConfigError(f"setup(): unknown strategy option {key!r}")
        setattr(cfg, key, value)
    cfg.name = strategy
    strat = build_strategy(ctx, cfg)
    if tp_plan is not None:
        if not hasattr(strat, "user_tp_plan"):
            raise ConfigError(f"setup(): tp_plan is for tensor-parallel strategies, not {strategy!r}")
        strat.user_tp_plan = tp_plan
    deferred = has_meta_parameters(model)  # a Hugging Face model built with its weights still in the files
    names = parameter_names(model)
    model = strat.apply_tensor_parallel(to_device(model, ctx.device))
    if deferred and not strat.materializes_after_wrap():
        materialize_deferred(model, ctx.device)
        if not hasattr(strat, "user_tp_plan"):  # model-parallel wraps rebind by name themselves
            optimizer = rebind_optimizer(optimizer, names, model)
    wrapped, opt = strat.wrap(model, optimizer)
    if deferred and strat.materializes_after_wrap():  # FSDP2 sharded the meta model: fill each rank's shard
        names = parameter_names(wrapped)
        materialize_deferred(wrapped, ctx.device)
        opt = rebind_optimizer(opt, names, wrapped)
    return Prepared(wrapped, opt, strat)
