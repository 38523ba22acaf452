"""Every strategy name as data: what it shards, its preset degrees, its capabilities, and its refusals.

A strategy name is a preset over the run's one :class:`~paratrain.spec.topology.Topology`. Everything that
can be decided without torch is decided here, once, and read by every part that needs it: ``paratrain
train``'s launcher (:func:`resolve` then :func:`check`), the strategy classes in :mod:`paratrain.parallel`
(which only *run* a spec: their registry maps a spec name to a class), the planner and ``paratrain
strategies``. A new strategy is one :class:`StrategySpec` here plus one behaviour class.

Presets (the degrees the flags leave open):

- data parallel: ``ddp``/``dp``/``tp``/``pp`` replicate over the data-parallel ranks; ``zero1/2/3`` and every
  ``fsdp+*`` shard over them; ``hsdp`` shards within a node and replicates across nodes (``--shard-size``
  overrides; on one node it shards over half the ranks);
- model parallel: ``tp``/``pp`` take every rank left (``rest``); the ``fsdp+*`` presets give their own model
  axes degree 2 (a TP pair inside a node, two pipeline stages), FSDP takes the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from paratrain.config import COMM_ALGORITHMS, StrategyConfig
from paratrain.errors import ConfigError, suggest
from paratrain.spec.topology import AXES, Topology

__all__ = [
    "ALIASES",
    "PP_SCHEDULES",
    "STRATEGIES",
    "StrategySpec",
    "canonical",
    "check",
    "check_comm_algorithm",
    "get",
    "names",
    "resolve",
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
            "fsdp+tp+pp", "3-D: pipeline stages, tensor parallel inside each (innermost axis), FSDP2 over the rest",
            sharding="full", dp_preset="shard", uses_tp=True, uses_pp=True, pp_schedules=PP_SCHEDULES, supports_mixed_precision=True, required_axes=_ALL,
        ),
    )
}  # fmt: skip
"""The registry of names, in the order ``paratrain strategies`` lists them."""

ALIASES: dict[str, str] = {a: s.name for s in STRATEGIES.values() for a in s.aliases}


def names(include_aliases: bool = True) -> list[str]:
    """Every strategy name (and alias), sorted."""
    return sorted([*STRATEGIES, *(ALIASES if include_aliases else ())])


def canonical(name: str) -> str:
    """The registered name of ``name`` (an alias resolved); :class:`ConfigError` with a suggestion otherwise."""
    resolved = ALIASES.get(name, name)
    if resolved not in STRATEGIES:
        raise ConfigError(f"unknown strategy {name!r}. {suggest(name, names())}")
    return resolved


def get(name: str) -> StrategySpec:
    return STRATEGIES[canonical(name)]


def strategies_taking(algorithm: str) -> list[str]:
    """The strategies whose ``--comm-algorithm`` may be ``algorithm``, sorted."""
    return sorted(n for n, s in STRATEGIES.items() if algorithm in s.comm_algorithms)


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


# ---- refusals -----------------------------------------------------------------------------------------
def check(name: str, world_size: int, config: StrategyConfig, gpus_per_node: int | None = None) -> Topology:
    """Every refusal that needs no model: options the strategy does not take, degrees it cannot run, the
    communication algorithm, the pipeline schedule. Returns the resolved topology."""
    spec = get(name)
    _check_options(spec, config)
    topology = resolve(name, world_size, config, gpus_per_node)
    if spec.name == "single":
        _check_single(topology)
    elif spec.model_parallel:
        _check_model_parallel(spec, topology, config)
    else:
        _check_data_parallel(spec, topology, config, gpus_per_node or world_size)
    if spec.uses_ep:
        _check_expert_parallel(spec, topology)
    check_comm_algorithm(spec.name, config.comm_algorithm)
    return topology


def _check_expert_parallel(spec: StrategySpec, topology: Topology) -> None:
    if topology.ep == 1 and topology.world_size > 1:
        raise ConfigError(
            f"strategy {spec.name!r} splits the experts over an ep axis, but it came out as ep 1 on "
            f"{topology.world_size} ranks. Give --ep N (N > 1, dividing the ranks), or use --strategy "
            f"{'zero3' if spec.uses_fsdp else 'ddp'} to replicate the experts."
        )
    if spec.uses_fsdp and topology.dp_replicate > 1:
        raise ConfigError(
            f"strategy {spec.name!r} shards over all data-parallel ranks; --dp-replicate "
            f"{topology.dp_replicate} is not supported with expert parallelism. Leave it out."
        )


def _able(capability: str) -> str:
    return ", ".join(sorted(n for n, s in STRATEGIES.items() if getattr(s, capability)))


def _check_options(spec: StrategySpec, config: StrategyConfig) -> None:
    if config.offload and not spec.supports_offload:
        raise ConfigError(
            f"--offload (strategy.offload) does not work with strategy {spec.name!r}: it keeps full model "
            f"state on the device. Strategies that can offload: {_able('supports_offload')}."
        )
    if config.mixed_precision != "fp32" and not spec.supports_mixed_precision:
        raise ConfigError(
            f"strategy.mixed_precision={config.mixed_precision!r} is FSDP2's policy and needs one of "
            f"{_able('supports_mixed_precision')}; with {spec.name!r} use --precision bf16 (autocast) instead."
        )
    if config.ep is not None and not spec.uses_ep:
        raise ConfigError(
            f"--ep {config.ep} splits the experts of a mixture-of-experts model, which strategy {spec.name!r} "
            f"does not do. Use --strategy {' or '.join(n for n, x in STRATEGIES.items() if x.uses_ep)}, or leave "
            "--ep out."
        )
    if config.shard_size is not None and not spec.uses_shard_size:
        raise ConfigError(
            f"--shard-size (strategy.shard_size) applies to hsdp only, not {spec.name!r}. "
            "Use --strategy hsdp --shard-size N, or leave --shard-size out."
        )
    # Tensor- and pipeline-parallel options given to a strategy without that axis are refused, not ignored.
    # A value equal to the default (--pp-schedule 1f1b, --sequence-parallel) cannot be told from an unset one.
    for axis, flags in (
        ("tp", [("--loss-parallel", config.loss_parallel),
                ("--no-sequence-parallel", not config.sequence_parallel)]),
        ("pp", [(f"--pp-schedule {config.pp_schedule}", config.pp_schedule != "1f1b"),
                (f"--microbatches {config.microbatches}", config.microbatches is not None)]),
    ):  # fmt: skip
        given = [flag for flag, on in flags if on]
        if given and not getattr(spec, f"uses_{axis}"):
            kind = "tensor parallelism" if axis == "tp" else "a pipeline"
            raise ConfigError(
                f"{' '.join(given)} applies to {kind}, which strategy {spec.name!r} does not have. Use a "
                f"strategy with {kind} ({_able(f'uses_{axis}')}), or leave {'them' if len(given) > 1 else 'it'} out."
            )


def _check_single(topology: Topology) -> None:
    if topology.world_size > 1:
        raise ConfigError(
            f"strategy 'single' runs one process but the world size is {topology.world_size}. "
            "Use --nproc-per-node 1, or a data-parallel strategy such as --strategy ddp."
        )


def _check_data_parallel(spec: StrategySpec, topology: Topology, config: StrategyConfig, node: int) -> None:
    if topology.tp > 1 or topology.pp > 1:
        raise ConfigError(
            f"strategy {spec.name!r} is data parallel only, but --tp {topology.tp} --pp {topology.pp} were "
            "given. Use --strategy tp, fsdp+tp, pp, fsdp+pp or fsdp+tp+pp for model parallelism."
        )
    if spec.shard_axis_only and topology.dp_replicate > 1:
        given = (
            f"--dp-replicate {config.dp_replicate}"
            if config.dp_replicate is not None
            else f"--dp-shard {config.dp_shard}"
        )
        raise ConfigError(
            f"strategy {spec.name!r} shards over all {topology.dp_size} data-parallel ranks, but {given} "
            f"splits them into {topology.dp_replicate} replicas of {topology.dp_shard}, which {spec.name} "
            "would never average (each replica would train on its own data). Leave out --dp-replicate/"
            "--dp-shard, or, to shard within groups and replicate across them, use --strategy hsdp "
            f"--dp-replicate {topology.dp_replicate}."
        )
    if topology.dp_shard > 1 and spec.dp_preset == "replicate":
        raise ConfigError(
            f"strategy {spec.name!r} replicates the model; --dp-shard {topology.dp_shard} needs a sharded "
            "strategy (zero1, zero2, zero3, hsdp)."
        )


def _check_own_axes(spec: StrategySpec, topology: Topology, config: StrategyConfig) -> None:
    """Refuse a preset whose own axis (``tp`` and/or ``pp``) has degree 1: given so (``--tp 1``) or left to
    the preset's default on a world it does not divide."""
    lost = [axis for axis, used, degree in (("tp", spec.uses_tp, topology.tp), ("pp", spec.uses_pp, topology.pp))
            if used and degree == 1 and topology.world_size > 1]  # fmt: skip
    if not lost:
        return
    explicit = [a for a in lost if getattr(config, a) is not None]
    if explicit:
        flags = " ".join(f"--{a} 1" for a in explicit)
        rest = [a for a in ("tp", "pp") if getattr(spec, f"uses_{a}") and a not in explicit]
        without = "fsdp+" + "+".join(rest) if rest else ("zero3" if spec.uses_fsdp else "ddp")
        raise ConfigError(
            f"strategy {spec.name!r} splits the model over its {' and '.join(explicit)} axis, but {flags} was "
            f"given, which would run it without that axis. Give a degree above 1 that divides the "
            f"{topology.world_size} ranks, or use --strategy {without}."
        )
    asked = " x ".join(f"{a} {getattr(topology, a)}" for a in ("tp", "pp") if getattr(spec, f"uses_{a}"))
    raise ConfigError(
        f"strategy {spec.name!r} on {topology.world_size} ranks came out as {asked}: its "
        f"{' and '.join(lost)} axis would have degree 1, so the job would run without it. Give "
        + " and ".join(f"--{a} N (N > 1, dividing the ranks)" for a in lost)
        + f", run on a multiple of {2 ** (int(spec.uses_tp) + int(spec.uses_pp))} ranks, or use a strategy "
        "without that axis."
    )


def _check_model_parallel(spec: StrategySpec, topology: Topology, config: StrategyConfig) -> None:
    _check_own_axes(spec, topology, config)
    if topology.tp > 1 and not spec.uses_tp:
        raise ConfigError(
            f"strategy {spec.name!r} does not split tensors, but --tp {topology.tp} was given. "
            "Use --strategy fsdp+tp+pp to combine pipeline and tensor parallelism."
        )
    if topology.pp > 1 and not spec.uses_pp:
        raise ConfigError(
            f"strategy {spec.name!r} has no pipeline, but --pp {topology.pp} was given. Use --strategy "
            "fsdp+tp+pp to combine tensor and pipeline parallelism."
        )
    if topology.dp_shard > 1 and not spec.uses_fsdp:
        raise ConfigError(
            f"strategy {spec.name!r} replicates the model over its {topology.dp_size} data-parallel ranks; "
            f"--dp-shard {topology.dp_shard} needs FSDP: use --strategy fsdp+{spec.name}."
        )
    if config.loss_parallel and topology.tp == 1 and spec.uses_tp and topology.world_size > 1:
        raise ConfigError("--loss-parallel shards the logits over tp ranks; it needs --tp 2 or more.")
    if spec.uses_pp:
        _check_schedule(topology, config)


def _check_schedule(topology: Topology, config: StrategyConfig) -> None:
    m, p = config.microbatches or topology.pp, topology.pp
    if config.pp_schedule == "1f1b" and m < p:
        raise ConfigError(
            f"--pp-schedule 1f1b needs at least as many micro-batches as stages: --microbatches {m} < "
            f"--pp {p}. Use --microbatches {p} or more, or --pp-schedule gpipe."
        )
    if config.pp_schedule == "interleaved-1f1b":
        rounds = max(1, m // p)
        if m % rounds:
            raise ConfigError(
                f"--pp-schedule interleaved-1f1b runs the micro-batches in rounds of --pp {p}: "
                f"--microbatches {m} must be a multiple of {rounds} (e.g. {rounds * p})."
            )


def check_comm_algorithm(name: str, algorithm: str) -> None:
    """Refuse a ``--comm-algorithm`` strategy ``name`` does not implement, instead of ignoring it."""
    spec = get(name)
    if algorithm in spec.comm_algorithms:
        return
    takes = " or ".join(repr(a) for a in spec.comm_algorithms)
    able = strategies_taking(algorithm)
    where = f"Strategies that take {algorithm!r}: {', '.join(able)}." if able else "No strategy takes it."
    helps = f" ({spec.comm_algorithms_help})" if spec.comm_algorithms_help else ""
    raise ConfigError(
        f"strategy {spec.name}: --comm-algorithm {algorithm!r} is not available; {spec.name} takes {takes}"
        f"{helps}. {where}"
    )


assert all(a in AXES for s in STRATEGIES.values() for a in s.required_axes)
