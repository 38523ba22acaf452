"""Every strategy name as data: what it shards, its preset degrees, its capabilities, and its refusals.

A strategy name is a preset over the run's one :class:`~paratrain.spec.topology.Topology`. Everything that
can be decided without torch is decided here, once, and read by every part that needs it: ``paratrain
train``'s launcher (:func:`resolve` then :func:`check`), the strategy classes in :mod:`paratrain.parallel`
(which only *run* a spec: their registry maps a spec name to a class), the planner and ``paratrain
strategies``. A new strategy is one :class:`StrategySpec` here plus one behaviour class. The presets are
:mod:`.presets` (:func:`~paratrain.spec.presets.resolve`), the refusals :mod:`.refusals`
(:func:`~paratrain.spec.refusals.check`).

Presets (the degrees the flags leave open):

- data parallel: ``ddp``/``dp``/``tp``/``pp`` replicate over the data-parallel ranks; ``zero1/2/3`` and every
  ``fsdp+*`` shard over them; ``hsdp`` shards within a node and replicates across nodes (``--shard-size``
  overrides; on one node it shards over half the ranks);
- model parallel: ``tp``/``pp`` take every rank left (``rest``); the ``fsdp+*`` presets give their own model
  axes degree 2 (a TP pair inside a node, two pipeline stages), FSDP takes the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from paratrain.config import COMM_ALGORITHMS
from paratrain.errors import ConfigError, suggest
from paratrain.spec.topology import AXES

__all__ = [
    "ALIASES",
    "PLANNED_ONLY",
    "PP_SCHEDULES",
    "STRATEGIES",
    "StrategySpec",
    "canonical",
    "get",
    "names",
    "strategies_taking",
]

Sharding = Literal["none", "optimizer", "grads", "full"]
PP_SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class StrategySpec:
    """One strategy name: its preset and what it accepts. Pure data; no torch."""

    name: str
    description: str
    sharding: Sharding = "none"
    """What the ``dp_shard`` axis shards: ``none`` (replicas), ``optimizer`` (ZeRO-1), ``grads`` (ZeRO-2:
    optimizer + gradients), ``full`` (ZeRO-3 / FSDP: + parameters)."""
    aliases: tuple[str, ...] = ()
    dp_preset: Literal["replicate", "shard", "hybrid", "one"] = "replicate"
    """How the data-parallel ranks split when neither ``--dp-replicate`` nor ``--dp-shard`` is given."""
    uses_tp: bool = False
    uses_pp: bool = False
    tp_default: Literal["rest", "two"] = "two"
    """``--tp`` left out: every rank not taken by another axis (``rest``) or 2 when the ranks divide by 2."""
    pp_default: Literal["rest", "two"] = "two"
    supports_offload: bool = False
    """Accepts ``--offload`` (CPU offload of FSDP2's sharded state)."""
    supports_mixed_precision: bool = False
    """Accepts ``strategy.mixed_precision`` other than fp32 (FSDP2's policy)."""
    uses_shard_size: bool = False
    """Accepts ``--shard-size``."""
    shard_axis_only: bool = False
    """Synchronises over ``dp_shard`` alone: a ``dp_replicate`` above 1 is refused."""
    comm_algorithms: tuple[str, ...] = ("native",)
    """``--comm-algorithm`` values it implements; any other is refused."""
    comm_algorithms_help: str = ""
    required_axes: tuple[str, ...] = ()
    """Mesh axes built even at degree 1 (FSDP2 always shards over ``dp_shard``)."""
    fp16_scaling: bool = True
    """Whether fp16 loss scaling can work (ZeRO-1/2 free gradients before a scaler could unscale them)."""
    compiles_with_tp: bool = False
    """``--compile`` with ``tp > 1`` (not in torch 2.13: the compiled backward fails on DTensor gradients)."""
    pp_schedules: tuple[str, ...] = field(default=())
    uses_ep: bool = False
    """Splits the experts of an MoE model over an ``ep`` axis borrowed from the data-parallel ranks."""
    ep_default: Literal["rest", "two"] = "rest"
    """``--ep`` left out: every data-parallel rank (``rest``) or 2 when they divide by 2."""

    @property
    def model_parallel(self) -> bool:
        return self.uses_tp or self.uses_pp

    @property
    def uses_fsdp(self) -> bool:
        """Parameters sharded with FSDP2 over the data-parallel ranks."""
        return self.sharding == "full"

    def capabilities(self) -> dict[str, object]:
        """What ``paratrain strategies --json`` reports of it."""
        return {
            "sharding": self.sharding,
            "tp": self.uses_tp,
            "pp": self.uses_pp,
            "offload": self.supports_offload,
            "mixed_precision": self.supports_mixed_precision,
            "shard_size": self.uses_shard_size,
            "comm_algorithms": list(self.comm_algorithms),
            "pp_schedules": list(self.pp_schedules),
            "fp16": self.fp16_scaling,
            "ep": self.uses_ep,
        }


_ALL = ("pp", "dp_replicate", "dp_shard", "tp")
_SHM = "'native': the backend's reduce-scatter and all-gather; 'shm': through shared memory"
_A2A = (
    "the token all-to-all: 'native' is the backend's all_to_all_single, 'pairwise' paratrain.comm's send/recv"
)

STRATEGIES: dict[str, StrategySpec] = {
    s.name: s
    for s in (
        StrategySpec("single", "one process, no communication (the reference)", dp_preset="one"),
        StrategySpec(
            "ddp", "torch DistributedDataParallel: replicated model, bucketed async gradient all-reduce",
            comm_algorithms=("native", "shm"),
            comm_algorithms_help="'native': torch's reducer all-reduces each bucket; 'shm': a comm hook through "
            "shared memory",
        ),
        StrategySpec(
            "dp", "paratrain's own data parallel: bucketed all-reduce (--comm-algorithm) overlapped with "
            "backward", comm_algorithms=tuple(a for a in COMM_ALGORITHMS if a != "pairwise"),
        ),
        StrategySpec(
            "zero1", "ZeRO-1: optimizer state sharded; gradients reduce-scattered + parameters all-gathered (2Ψ)",
            sharding="optimizer", dp_preset="shard", shard_axis_only=True, comm_algorithms=("native", "shm"),
            comm_algorithms_help=_SHM, fp16_scaling=False,
        ),
        StrategySpec(
            "zero2", "ZeRO-2: optimizer state and gradients sharded (reduce-scatter in backward); params "
            "replicated", sharding="grads", dp_preset="shard", shard_axis_only=True,
            comm_algorithms=("native", "shm"), comm_algorithms_help=_SHM, fp16_scaling=False,
        ),
        StrategySpec(
            "zero3", "ZeRO-3 / FSDP2: parameters, gradients and optimizer state sharded (fully_shard per block)",
            sharding="full", aliases=("fsdp",), dp_preset="shard", supports_offload=True,
            supports_mixed_precision=True, shard_axis_only=True, required_axes=("dp_shard",),
        ),
        StrategySpec(
            "hsdp", "hybrid sharded DP: FSDP2 within --shard-size groups, replicated across groups (2-D mesh)",
            sharding="full", dp_preset="hybrid", supports_offload=True, supports_mixed_precision=True,
            uses_shard_size=True, required_axes=("dp_replicate", "dp_shard"),
        ),
        StrategySpec(
            "tp", "tensor parallel (Megatron, DTensor): every rank holds 1/tp of each layer; replicas over the rest",
            uses_tp=True, tp_default="rest", required_axes=_ALL,
        ),
        StrategySpec(
            "fsdp+tp", "2-D: tensor parallel inside a node (innermost axis), FSDP2 over the data-parallel ranks",
            sharding="full", dp_preset="shard", uses_tp=True, supports_mixed_precision=True, required_axes=_ALL,
        ),
        StrategySpec(
            "pp", "pipeline parallel (torch.distributed.pipelining): stages of whole layers; replicas over the "
            "rest", uses_pp=True, pp_default="rest", required_axes=_ALL, pp_schedules=PP_SCHEDULES,
        ),
        StrategySpec(
            "fsdp+pp", "2-D: pipeline stages (outermost axis), each sharded with FSDP2 over the data-parallel ranks",
            sharding="full", dp_preset="shard", uses_pp=True, pp_schedules=PP_SCHEDULES, supports_mixed_precision=True, required_axes=_ALL,
        ),
        StrategySpec(
            "ep", "expert parallel: each MoE layer's experts split over --ep ranks (all-to-all), dense replicated",
            uses_ep=True, required_axes=_ALL, comm_algorithms=("native", "pairwise"), comm_algorithms_help=_A2A,
        ),
        StrategySpec(
            "fsdp+ep", "FSDP2 over the data-parallel ranks; experts split over --ep of them and FSDP over the rest",
            sharding="full", dp_preset="shard", uses_ep=True, ep_default="two", supports_mixed_precision=True,
            required_axes=_ALL, comm_algorithms=("native", "pairwise"), comm_algorithms_help=_A2A,
        ),
        StrategySpec(
            "fsdp+tp+ep", "2-D dense (tensor parallel inside a node, FSDP2 over the rest); experts split over --ep "
            "ranks borrowed from dp_shard x tp, FSDP over the ranks left", sharding="full", dp_preset="shard",
            uses_tp=True, uses_ep=True, ep_default="two", supports_mixed_precision=True, required_axes=_ALL,
            comm_algorithms=("native", "pairwise"), comm_algorithms_help=_A2A,
        ),
        StrategySpec(
            "fsdp+ep+pp", "pipeline stages (outermost axis), each an fsdp+ep layout: experts split over --ep of the "
            "stage's data-parallel ranks, FSDP2 over the rest", sharding="full", dp_preset="shard", uses_pp=True,
            uses_ep=True, ep_default="two", pp_schedules=PP_SCHEDULES, supports_mixed_precision=True,
            required_axes=_ALL, comm_algorithms=("native", "pairwise"), comm_algorithms_help=_A2A,
        ),
        StrategySpec(
            "fsdp+tp+pp", "3-D: pipeline stages, tensor parallel inside each (innermost axis), FSDP2 over the rest",
            sharding="full", dp_preset="shard", uses_tp=True, uses_pp=True, pp_schedules=PP_SCHEDULES, supports_mixed_precision=True, required_axes=_ALL,
        ),
    )
}  # fmt: skip
"""The registry of names, in the order ``paratrain strategies`` lists them."""

ALIASES: dict[str, str] = {a: s.name for s in STRATEGIES.values() for a in s.aliases}

PLANNED_ONLY: dict[str, str] = {}
"""Layouts ``paratrain plan`` costs that ``paratrain train`` does not run yet (refused by :func:`canonical` with
what exists instead)."""


def names(include_aliases: bool = True) -> list[str]:
    """Every strategy name (and alias), sorted."""
    return sorted([*STRATEGIES, *(ALIASES if include_aliases else ())])


def canonical(name: str) -> str:
    """The registered name of ``name`` (an alias resolved); :class:`ConfigError` with a suggestion otherwise."""
    resolved = ALIASES.get(name, name)
    if resolved in PLANNED_ONLY:
        raise ConfigError(
            f"strategy {name!r} ({PLANNED_ONLY[name]}) is planned (paratrain plan --strategy {name}) but not "
            f"trained yet. Use one of: {', '.join(names(include_aliases=False))}."
        )
    if resolved not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}. {suggest(name, names())}")
    return resolved


def get(name: str) -> StrategySpec:
    return STRATEGIES[canonical(name)]


def strategies_taking(algorithm: str) -> list[str]:
    """The strategies whose ``--comm-algorithm`` may be ``algorithm``, sorted."""
    return sorted(n for n, s in STRATEGIES.items() if algorithm in s.comm_algorithms)


assert all(a in AXES for s in STRATEGIES.values() for a in s.required_axes)
