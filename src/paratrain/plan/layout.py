"""Layouts (the four degrees of a run) and the strategy names the planner knows, resolved from the flags.

A layout is DESIGN.md's one topology: ``dp_replicate × dp_shard × tp × pp == GPUs``, laid out with ``tp``
innermost (consecutive ranks, one node), then ``dp_shard``, ``dp_replicate``, and ``pp`` outermost. A
strategy name says what the data-parallel axes shard (:data:`STRATEGIES`); the names are the registry's
(``paratrain strategies``), kept here as plain data so that planning never imports ``torch.distributed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paratrain.errors import ConfigError, suggest
from paratrain.plan.model import TransformerShape

MESH_ORDER: tuple[str, ...] = ("tp", "dp_shard", "dp_replicate", "pp")
"""Axes innermost first: an axis's ranks are ``stride`` apart, stride = product of the axes before it."""


@dataclass(frozen=True)
class Layout:
    """Degrees of every axis (the JSON ``layout``)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in MESH_ORDER:
            v = getattr(self, axis)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"layout: {axis} must be a positive integer, got {v!r}.")

    @property
    def gpus(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    def degree(self, axis: str) -> int:
        return int(getattr(self, axis))

    def stride(self, axis: str) -> int:
        """Distance in rank numbers between neighbours of ``axis``'s groups."""
        return math.prod(self.degree(a) for a in MESH_ORDER[: MESH_ORDER.index(axis)])

    def to_dict(self) -> dict[str, int]:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp, "pp": self.pp}

    def describe(self) -> str:
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp}x{self.pp}"


@dataclass(frozen=True)
class StrategyInfo:
    name: str
    sharding: str
    """What the ``dp_shard`` axis shards: ``none`` (replicas), ``optimizer`` (ZeRO-1), ``grads`` (ZeRO-2:
    optimizer + gradients), ``full`` (ZeRO-3 / FSDP: + parameters)."""
    description: str


STRATEGIES: dict[str, StrategyInfo] = {
    s.name: s
    for s in (
        StrategyInfo("single", "none", "one process"),
        StrategyInfo("ddp", "none", "torch DDP: replicas, gradient all-reduce"),
        StrategyInfo("dp", "none", "paratrain's bucketed data parallel (as ddp)"),
        StrategyInfo("zero1", "optimizer", "ZeRO-1: optimizer state sharded"),
        StrategyInfo("zero2", "grads", "ZeRO-2: optimizer state and gradients sharded"),
        StrategyInfo("zero3", "full", "ZeRO-3 / FSDP2: everything sharded"),
        StrategyInfo("hsdp", "full", "FSDP2 within dp_shard groups, replicas across dp_replicate"),
        StrategyInfo("tp", "none", "Megatron tensor parallel (leftover ranks replicate)"),
        StrategyInfo("pp", "none", "pipeline parallel (leftover ranks replicate)"),
        StrategyInfo("fsdp+tp", "full", "FSDP2 over dp, tensor parallel inside a node"),
        StrategyInfo("fsdp+pp", "full", "FSDP2 over dp, pipeline stages"),
        StrategyInfo("fsdp+tp+pp", "full", "FSDP2 x tensor parallel x pipeline"),
    )
}
ALIASES = {"fsdp": "zero3"}
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")


def canonical(strategy: str) -> StrategyInfo:
    name = ALIASES.get(strategy, strategy)
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}. {suggest(strategy, [*STRATEGIES, *ALIASES])}")
    return STRATEGIES[name]


def name_for(layout: Layout) -> str:
    """The registered strategy that runs ``layout`` (data parallel over ``dp_shard`` is FSDP)."""
    if layout.tp == 1 and layout.pp == 1:
        if layout.gpus == 1:
            return "single"
        if layout.dp_shard == 1:
            return "ddp"
        return "hsdp" if layout.dp_replicate > 1 else "zero3"
    if layout.dp_shard == 1 and layout.dp_replicate > 1 and (layout.tp == 1 or layout.pp == 1):
        return "tp" if layout.pp == 1 else "pp"
    if layout.dp == 1 and (layout.tp == 1) != (layout.pp == 1):
        return "tp" if layout.pp == 1 else "pp"
    parts = ["fsdp"] + (["tp"] if layout.tp > 1 else []) + (["pp"] if layout.pp > 1 else [])
    return "+".join(parts)


def valid_tp(shape: TransformerShape | None, limit: int) -> list[int]:
    """TP degrees ≤ ``limit`` that divide the heads and the KV heads (1 for a model that is not a transformer)."""
    if shape is None:
        return [1]
    return [t for t in range(1, limit + 1) if shape.n_heads % t == 0 and shape.n_kv_heads % t == 0]


def check(layout: Layout, gpus: int, shape: TransformerShape | None, model: str = "the model") -> None:
    """Raise :class:`ConfigError` naming every factor when ``layout`` cannot run on ``gpus`` GPUs."""
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


def _train_defaults(
    name: str, gpus: int, tp: int | None, pp: int | None, dp_shard: int | None, dp_replicate: int | None
) -> tuple[int, int]:
    """The tp and pp ``paratrain train`` picks for this preset on ``gpus`` ranks (the preset's own rule,
    :meth:`paratrain.parallel.tensor.ModelParallel.topology_for`), given degrees kept (``None``: not given)."""
    from paratrain.config import StrategyConfig
    from paratrain.parallel import get_strategy

    config = StrategyConfig(name=name, tp=tp, pp=pp, dp_shard=dp_shard, dp_replicate=dp_replicate)
    topo = get_strategy(name).topology_for(gpus, config)
    return topo.tp, topo.pp


def check_as_train(name: str, gpus: int, **options: Any) -> None:
    """Refuse what ``paratrain train --strategy NAME`` on ``gpus`` ranks refuses before launch, with train's
    message: train's own check (:func:`paratrain.parallel.check_strategy`) on the degrees and ``options``
    (:class:`~paratrain.config.StrategyConfig` fields: the tensor- and pipeline-parallel flags a strategy
    without that axis refuses, ``--offload``, a preset's own axis at degree 1, ...)."""
    from paratrain.config import StrategyConfig
    from paratrain.parallel import check_strategy, get_strategy

    check_strategy(get_strategy(name), gpus, StrategyConfig(name=name, **options))


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
) -> tuple[str, str, Layout]:
    """``(strategy name, sharding, layout)`` from ``--strategy`` and the degree flags, validated.

    A named strategy is first checked as ``paratrain train`` checks it (:func:`check_as_train`), with
    ``options``: the :class:`~paratrain.config.StrategyConfig` fields of the workload (``microbatches``,
    ``pp_schedule``, ``sequence_parallel``, ``loss_parallel``, ``offload``).

    Degrees not given default the way ``paratrain train`` does (the preset's own rule: ``tp`` and ``pp`` take
    every rank, ``fsdp+tp``/``fsdp+pp``/``fsdp+tp+pp`` take 2 for their axes); the data-parallel degree is
    what is left; ``hsdp`` shards within a node.
    """
    for flag, v in (("--tp", tp), ("--pp", pp), ("--dp-shard", dp_shard), ("--dp-replicate", dp_replicate)):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be at least 1, got {v}.")
    info = canonical(strategy) if strategy else None
    name = info.name if info else None
    if name is not None:  # what train refuses before launch, plan refuses with the same message
        degrees = {"tp": tp, "pp": pp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}
        check_as_train(name, gpus, **degrees, **(options or {}))
    if name in ("tp", "fsdp+tp", "fsdp+tp+pp", "pp", "fsdp+pp"):
        tp, pp = _train_defaults(name, gpus, tp, pp, dp_shard, dp_replicate)
    tp, pp = tp or 1, pp or 1
    if dp_shard is None or dp_replicate is None:  # one data-parallel degree is inferred: the rest must divide
        given = {"tp": tp, "pp": pp, "dp_shard": dp_shard, "dp_replicate": dp_replicate}
        known = {k: v for k, v in given.items() if v is not None}
        if gpus % math.prod(known.values()):
            factors = " x ".join(f"{k} {v}" for k, v in known.items())
            raise ConfigError(
                f"{factors} = {math.prod(known.values())} does not divide the {gpus} GPUs, so the data-parallel "
                f"degree cannot be inferred. Choose degrees whose product divides {gpus}."
            )
    rest = gpus // (tp * pp) if gpus % (tp * pp) == 0 else 0
    if dp_shard is None and dp_replicate is None:
        if name == "hsdp":
            dp_shard = math.gcd(rest, gpus_per_node) if rest > gpus_per_node else max(1, rest // 2)
        dp_shard = dp_shard or (1 if name in ("ddp", "dp", "tp", "pp") else rest)
    if dp_shard is None:
        dp_shard = rest // (dp_replicate or 1)
    if dp_replicate is None:
        dp_replicate = rest // dp_shard
    layout = Layout(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp)
    check(layout, gpus, shape, model)
    if name is None:
        name = name_for(layout)
    if name in ("zero1", "zero2", "zero3") and layout.dp_replicate > 1:
        raise ConfigError(
            f"--strategy {name} shards over all ranks; for replicas x shards use --strategy hsdp."
        )
    sharding = STRATEGIES[name].sharding
    if sharding == "none" and layout.dp_shard > 1:
        sharding = "full"  # explicit --dp-shard with tp/pp: FSDP over it
    return name, sharding, layout
