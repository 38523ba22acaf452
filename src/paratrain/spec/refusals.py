"""Every refusal of a strategy that needs no model: options it does not take, degrees it cannot run, the
communication algorithm, the pipeline schedule. :func:`check` is the one place they are decided, before any
process starts; the messages name what is wrong and how to fix it. Torch-free.
"""

from __future__ import annotations

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.spec.presets import resolve
from paratrain.spec.strategies import STRATEGIES, StrategySpec, get, strategies_taking
from paratrain.spec.topology import Topology

__all__ = ["check", "check_comm_algorithm", "check_optimizer_kernel"]


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
        _check_expert_parallel(spec, topology, config)
    check_comm_algorithm(spec.name, config.comm_algorithm)
    return topology


def _check_expert_parallel(spec: StrategySpec, topology: Topology, config: StrategyConfig) -> None:
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
    if spec.uses_tp and topology.tp > 1 and not config.sequence_parallel:
        raise ConfigError(
            f"strategy {spec.name!r} routes each tp rank's own slice of the sequence (the MoE layers run "
            "sequence-parallel, so ep can borrow the tp ranks); --no-sequence-parallel would give every tp rank "
            "the same tokens. Leave sequence parallelism on, or use --strategy fsdp+ep."
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
    if config.shard_accumulated_grads and not (spec.uses_fsdp and not spec.uses_pp):
        able = ", ".join(n for n, x in STRATEGIES.items() if x.uses_fsdp and not x.uses_pp)
        raise ConfigError(
            f"--shard-accumulated-grads (strategy.shard_accumulated_grads) applies to the FSDP2 strategies "
            f"without a pipeline ({able}), not {spec.name!r}"
            + (": a pipeline schedule synchronises on its last micro-batch itself." if spec.uses_pp else ".")
            + " Leave it out."
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


def check_optimizer_kernel(name: str, topology: Topology, optimizer: str, implementation: str) -> None:
    """Refuse ``optimizer.implementation=fused`` where torch's fused kernel cannot take the parameters the
    strategy leaves (the worker would refuse it after building the model; ``auto`` falls back instead):
    ``ep`` alone mixes DTensors (its experts) with plain tensors, which one kernel call cannot take, and fused
    SGD has no DTensor rule, which every FSDP and tensor-parallel parameter is."""
    if implementation != "fused":
        return
    spec = get(name)
    fix = "Use --set optimizer.implementation=auto (fused where it can run) or for-loop."
    if spec.uses_ep and not spec.uses_fsdp and topology.ep > 1:
        raise ConfigError(
            f"optimizer.implementation=fused cannot run under {spec.name}: its experts are DTensors and its other "
            f"parameters plain tensors, and torch's fused kernel takes one kind per call. {fix}"
        )
    if optimizer == "sgd" and (spec.uses_fsdp or (spec.uses_tp and topology.tp > 1)):
        raise ConfigError(
            f"optimizer.implementation=fused cannot run for SGD under {spec.name}: its parameters are DTensors, "
            f"and DTensor has no sharding rule for torch's fused SGD. {fix}"
        )
