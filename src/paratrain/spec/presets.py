"""The topology a strategy name runs on a world: the degrees the flags leave open, filled by the preset.

:func:`resolve` is the one place presets are decided; ``paratrain train``'s launcher, the strategy classes and
the planner call it. Torch-free.
"""

from __future__ import annotations

import math

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.spec.strategies import StrategySpec, get
from paratrain.spec.topology import Topology

__all__ = ["resolve"]


# ---- presets: the topology of a world -----------------------------------------------------------------
def _dp_split(spec: StrategySpec, dp: int, config: StrategyConfig, gpus_per_node: int) -> tuple[int, int]:
    """``(dp_replicate, dp_shard)`` of the preset for ``dp`` data-parallel ranks."""
    if spec.dp_preset == "hybrid":
        return _hsdp_split(dp, config, gpus_per_node)
    if spec.dp_preset == "shard":
        return 1, dp
    return dp, 1


def _hsdp_split(dp: int, config: StrategyConfig, gpus_per_node: int) -> tuple[int, int]:
    """HSDP shards within a node and replicates across nodes: the shard group is the data-parallel ranks of
    one node (``gcd(dp, gpus_per_node)``) when the ranks span nodes, half of them on one node."""
    if dp < 2:
        raise ConfigError(
            f"hsdp needs at least 2 data-parallel ranks (it shards within groups and replicates across "
            f"groups), but there are {dp}. Use --nproc-per-node 2 or more, or --strategy zero3."
        )
    shard = config.shard_size or config.dp_shard
    if shard is None:
        if dp > gpus_per_node and math.gcd(dp, gpus_per_node) > 1:
            shard = math.gcd(dp, gpus_per_node)
        elif dp % 2:
            raise ConfigError(
                f"hsdp: the data-parallel size {dp} is odd, so there is no default shard size (half the "
                f"ranks). Give --shard-size, a divisor of {dp}."
            )
        else:
            shard = dp // 2
    if shard > dp or dp % shard:
        divisors = [d for d in range(1, dp + 1) if dp % d == 0]
        raise ConfigError(
            f"--shard-size {shard} does not divide the data-parallel size {dp} "
            f"(replicate x shard must equal {dp}). Choose one of: {', '.join(map(str, divisors))}."
        )
    return dp // shard, shard


def _model_axes(spec: StrategySpec, world_size: int, config: StrategyConfig) -> tuple[int, int]:
    """``(tp, pp)``: the flags when given (1 included: :func:`check` then refuses a preset's own axis at degree
    1); otherwise the preset's default. An axis the preset does not use defaults to 1."""
    degrees: dict[str, int | None] = {
        "tp": config.tp if config.tp is not None or not spec.uses_tp else None,
        "pp": config.pp if config.pp is not None or not spec.uses_pp else None,
    }
    degrees = {a: 1 if v is None and not getattr(spec, f"uses_{a}") else v for a, v in degrees.items()}
    free = [a for a, v in degrees.items() if v is None]
    if free:
        fixed = (degrees["tp"] or 1) * (degrees["pp"] or 1)
        dp_given = config.dp_replicate is not None or config.dp_shard is not None
        dp = (config.dp_replicate or 1) * (config.dp_shard or 1) if dp_given else 1
        avail = world_size // (fixed * dp) if world_size % (fixed * dp) == 0 else 1
        for i, axis in enumerate(free):
            default = spec.tp_default if axis == "tp" else spec.pp_default
            if i == len(free) - 1 and (dp_given or default == "rest"):
                value = avail  # the data-parallel degrees are set: the last free axis takes the rest
            else:
                value = 2 if avail % 2 == 0 else 1
            degrees[axis] = value
            avail //= value
    tp, pp = degrees["tp"], degrees["pp"]
    assert tp is not None and pp is not None
    return tp, pp


def resolve(name: str, world_size: int, config: StrategyConfig, gpus_per_node: int | None = None) -> Topology:
    """The topology ``--strategy NAME`` runs on ``world_size`` ranks (``gpus_per_node`` per node; default:
    one node): ``--tp``/``--pp`` first (or the preset's), the data-parallel rest split by the preset, explicit
    ``--dp-replicate``/``--dp-shard`` overriding it. Raises :class:`ConfigError` printing every factor."""
    spec = get(name)
    node = gpus_per_node or world_size
    tp, pp = (
        _model_axes(spec, world_size, config) if spec.model_parallel else (config.tp or 1, config.pp or 1)
    )
    if world_size % (tp * pp):
        raise ConfigError(
            f"topology: tp {tp} x pp {pp} = {tp * pp} does not divide the world size {world_size}. "
            f"Choose --tp and --pp whose product divides {world_size}."
        )
    dp = world_size // (tp * pp)
    rep, shard = config.dp_replicate, config.dp_shard
    if rep is None or shard is None:
        if rep is None and shard is None:
            rep, shard = _dp_split(spec, dp, config, node)
        elif rep is None:
            assert shard is not None
            rep = dp // shard if dp % shard == 0 else -1
        else:
            shard = dp // rep if dp % rep == 0 else -1
        if rep < 1 or shard < 1:
            given = config.dp_replicate if config.dp_replicate is not None else config.dp_shard
            flag = "--dp-replicate" if config.dp_replicate is not None else "--dp-shard"
            raise ConfigError(
                f"topology: {flag} {given} does not divide the {dp} data-parallel ranks (world "
                f"{world_size} / tp {tp} / pp {pp}). Give a {flag} that divides {dp}, or other --tp/--pp."
            )
    ep = _ep_degree(spec, rep * shard * tp, config)
    return Topology(world_size=world_size, dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp, ep=ep)


def _ep_degree(spec: StrategySpec, ranks: int, config: StrategyConfig) -> int:
    """``--ep``, else the preset's: every one of the ``ranks`` it borrows (``rest``) or 2; refused when it
    does not divide them."""
    if not spec.uses_ep:
        return 1
    ep = config.ep
    if ep is None:
        ep = ranks if spec.ep_default == "rest" else (2 if ranks % 2 == 0 else 1)
    if ranks % ep:
        raise ConfigError(
            f"--ep {ep} does not divide the {ranks} data-parallel ranks it borrows from. Give an --ep that "
            f"divides {ranks}."
        )
    return ep
