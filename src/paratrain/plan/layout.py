"""The layout of a planned run: :class:`~paratrain.spec.topology.Topology`, resolved from the flags exactly as
``paratrain train`` resolves it (:mod:`paratrain.spec.strategies`, the one place presets and refusals live),
plus what only a plan needs: the model-shape checks of a transformer and the strategy that runs a layout.
"""

from __future__ import annotations

from typing import Any

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.plan.model import TransformerShape
from paratrain.spec import strategies as specs
from paratrain.spec.refusals import check as spec_check
from paratrain.spec.topology import Topology

Layout = Topology
"""The planner's name for a run's topology (the JSON ``layout``: its four degrees)."""

STRATEGIES = specs.STRATEGIES
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")
"""The data-parallel presets the planner compares by default."""


def canonical(strategy: str) -> specs.StrategySpec:
    return specs.get(strategy)


def name_for(layout: Topology) -> str:
    """The registered strategy that runs ``layout`` (data parallel over ``dp_shard`` is FSDP)."""
    if layout.tp == 1 and layout.pp == 1:
        if layout.gpus == 1:
            return "single"
        if layout.dp_shard == 1:
            return "ddp"
        return "hsdp" if layout.dp_replicate > 1 else "zero3"
    if layout.dp_shard == 1 and (layout.tp == 1) != (layout.pp == 1):
        return "tp" if layout.pp == 1 else "pp"
    parts = ["fsdp"] + (["tp"] if layout.tp > 1 else []) + (["pp"] if layout.pp > 1 else [])
    return "+".join(parts)


def valid_tp(shape: TransformerShape | None, limit: int) -> list[int]:
    """TP degrees ≤ ``limit`` that divide the heads and the KV heads (1 for a model that is not a transformer)."""
    if shape is None:
        return [1]
    return [t for t in range(1, limit + 1) if shape.n_heads % t == 0 and shape.n_kv_heads % t == 0]


def check(layout: Topology, gpus: int, shape: TransformerShape | None, model: str = "the model") -> None:
    """Raise :class:`ConfigError` naming every factor when ``layout`` cannot run ``model`` on ``gpus`` GPUs."""
    if layout.gpus != gpus:
        raise ConfigError(
            f"dp_replicate {layout.dp_replicate} x dp_shard {layout.dp_shard} x tp {layout.tp} x pp {layout.pp} "
            f"= {layout.gpus}, but there are {gpus} GPUs. Choose degrees whose product is {gpus}."
        )
    if shape is None:
        if layout.tp > 1 or layout.pp > 1:
            raise ConfigError(
                f"--tp/--pp need a transformer (a model with dim/n_layers/n_heads, e.g. a llama preset); {model} "
                "is planned with data parallelism only (ddp, zero1, zero2, zero3, hsdp)."
            )
        return
    if shape.n_heads % layout.tp or shape.n_kv_heads % layout.tp:
        ok = ", ".join(map(str, valid_tp(shape, shape.n_heads)))
        raise ConfigError(
            f"tp {layout.tp} does not divide the {shape.n_heads} attention heads and {shape.n_kv_heads} KV heads "
            f"of {model}; choose tp from {ok}."
        )
    if layout.pp > shape.n_layers:
        raise ConfigError(
            f"pp {layout.pp} is larger than the {shape.n_layers} layers of {model}; choose pp <= {shape.n_layers}."
        )


def resolve(
    strategy: str | None,
    gpus: int,
    *,
    shape: TransformerShape | None,
    gpus_per_node: int,
    tp: int | None = None,
    pp: int | None = None,
    dp_shard: int | None = None,
    dp_replicate: int | None = None,
    model: str = "the model",
    options: dict[str, Any] | None = None,
) -> tuple[str, str, Topology]:
    """``(strategy name, sharding, layout)`` from ``--strategy`` and the degree flags, validated.

    A named strategy is resolved and checked by :func:`paratrain.spec.refusals.check`, the function
    ``paratrain train``'s launcher calls, with ``options`` (the :class:`~paratrain.config.StrategyConfig`
    fields of the workload: ``microbatches``, ``pp_schedule``, ``sequence_parallel``, ``loss_parallel``,
    ``offload``, ...): the same layout and the same refusals. Without ``--strategy`` the degrees given make the
    layout (unset ones 1, one data-parallel degree inferred) and the strategy is the one that runs it.
    """
    for flag, v in (("--tp", tp), ("--pp", pp), ("--dp-shard", dp_shard), ("--dp-replicate", dp_replicate)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be at least 1, got {v}.")
    if strategy:
        name = specs.canonical(strategy)
        config = StrategyConfig(name=name, tp=tp, pp=pp, dp_shard=dp_shard, dp_replicate=dp_replicate,
                                **(options or {}))  # fmt: skip
        layout = spec_check(name, gpus, config, gpus_per_node)
        check(layout, gpus, shape, model)
    else:
        layout = _from_degrees(gpus, tp or 1, pp or 1, dp_shard, dp_replicate)
        check(layout, gpus, shape, model)
        name = name_for(layout)
    sharding: str = specs.STRATEGIES[name].sharding
    if sharding == "none" and layout.dp_shard > 1:
        sharding = "full"  # explicit --dp-shard with tp/pp: FSDP over it
    return name, sharding, layout


def _from_degrees(gpus: int, tp: int, pp: int, dp_shard: int | None, dp_replicate: int | None) -> Topology:
    """The layout of explicit degrees, one data-parallel degree inferred (``dp_shard`` by default)."""
    known = {"tp": tp, "pp": pp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}
    fixed = {k: v for k, v in known.items() if v is not None}
    product = 1
    for v in fixed.values():
        product *= v
    if dp_shard is None or dp_replicate is None:
        if gpus % product:
            factors = " x ".join(f"{k} {v}" for k, v in fixed.items())
            raise ConfigError(
                f"{factors} = {product} does not divide the {gpus} GPUs, so the data-parallel degree cannot be "
                f"inferred. Choose degrees whose product divides {gpus}."
            )
        if dp_shard is None:
            dp_shard = gpus // product
            dp_replicate = dp_replicate or 1
        else:
            dp_replicate = gpus // product
    return Topology.of(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp)
