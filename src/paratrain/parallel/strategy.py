"""The strategy base class: what the trainer asks a parallel strategy for.

A strategy is a preset over the run's one :class:`~paratrain.parallel.topology.Topology` (which ranks
replicate, shard, split tensors or hold pipeline stages) plus the code that applies it to a model. The
trainer never branches on the strategy's name; it asks the strategy object:

- :meth:`Strategy.wrap` (once): replicate or shard the model, rebind the optimizer;
- :meth:`Strategy.forward_backward` (every step): run the micro-batches of one optimizer step and return
  the mean loss. The default runs forward and backward per micro-batch and suppresses gradient
  synchronisation on all but the last (:meth:`no_sync`); a pipeline schedule overrides the whole method,
  because it interleaves micro-batches across stages itself;
- :meth:`clip_grad_norm`, and the data-parallel coordinates the sampler uses (:attr:`dp_rank`,
  :attr:`dp_size`, :attr:`dp_group`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.parallel.topology import Topology
from paratrain.runtime import Context

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from paratrain.data.batch import Batch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Strategy:
    """Base class. Subclasses set the preset (:meth:`dp_degrees`) and override :meth:`wrap`."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    supports_offload: ClassVar[bool] = False
    """Accepts ``strategy.offload`` (``--offload``)."""
    supports_mixed_precision: ClassVar[bool] = False
    """Accepts ``strategy.mixed_precision`` other than ``fp32``."""
    uses_shard_size: ClassVar[bool] = False
    """Accepts ``strategy.shard_size`` (``--shard-size``)."""
    measures_peak_memory: ClassVar[bool] = True
    """Whether one step runs under ``MemTracker`` for ``peak_bytes_per_rank``."""
    peak_by_module: ClassVar[bool] = True
    """Whether the tracker may follow modules too. A pipeline schedule runs each stage module once per
    micro-batch, forward and backward interleaved, which MemTracker's per-module bookkeeping refuses; there
    it tracks storages only (the global peak is the same bookkeeping either way)."""
    replicated_gradients: ClassVar[bool] = False
    """After backward every data-parallel rank holds the same whole gradients (``ddp``, ``dp``): the
    non-finite check then reads only this rank's 1/``dp_size`` share of each, and the ranks combine their
    verdicts (``paratrain.train.nonfinite``)."""
    shard_axis_only: ClassVar[bool] = False
    """Every data-parallel rank is on the shard axis: the strategy synchronises over ``dp_shard`` alone
    (zero1, zero2, zero3), so a ``dp_replicate`` above 1 is refused (its replicas would never be averaged)."""
    required_axes: ClassVar[tuple[str, ...]] = ()
    """Mesh axes this strategy needs even at degree 1 (FSDP2 always shards over ``dp_shard``)."""
    comm_algorithms: ClassVar[tuple[str, ...]] = ("native",)
    """``--comm-algorithm`` values this strategy implements; any other is refused by :meth:`check` (the
    backend's own collectives, ``native``, unless a strategy widens it)."""
    comm_algorithms_help: ClassVar[str] = ""
    """What each of :attr:`comm_algorithms` means for this strategy (part of the refusal's message)."""

    def __init__(
        self,
        ctx: Context,
        config: StrategyConfig,
        topology: Topology | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        self.ctx = ctx
        self.config = config
        self.topology = topology or self.topology_for(ctx.world_size, config)
        self.mesh = mesh
        self._dp_group: Any = None

    # ---- the preset, checked in the launching process before any worker starts ---------------------
    @classmethod
    def dp_degrees(cls, dp: int, config: StrategyConfig) -> tuple[int, int]:
        """``(dp_replicate, dp_shard)`` of the preset for ``dp`` data-parallel ranks. Default: replicate."""
        return dp, 1

    @classmethod
    def topology_for(cls, world_size: int, config: StrategyConfig) -> Topology:
        """The run's topology: ``--tp``/``--pp`` first, the data-parallel rest split by the preset, explicit
        ``--dp-replicate``/``--dp-shard`` overriding it. Raises :class:`ConfigError` printing every factor."""
        tp, pp = config.tp or 1, config.pp or 1  # unset (None): no tensor or pipeline parallelism
        if world_size % (tp * pp):
            raise ConfigError(
                f"topology: tp {tp} x pp {pp} = {tp * pp} does not divide the world size {world_size}. "
                f"Choose --tp and --pp whose product divides {world_size}."
            )
        dp = world_size // (tp * pp)
        rep, shard = config.dp_replicate, config.dp_shard
        if rep is None or shard is None:
            preset_rep, preset_shard = cls.dp_degrees(dp, config)
            if rep is None and shard is None:
                rep, shard = preset_rep, preset_shard
            elif rep is None:
                assert shard is not None
                rep = dp // shard if dp % shard == 0 else -1
            else:
                shard = dp // rep if dp % rep == 0 else -1
            if rep is None or shard is None or rep < 1 or shard < 1:
                given = config.dp_replicate if config.dp_replicate is not None else config.dp_shard
                flag = "--dp-replicate" if config.dp_replicate is not None else "--dp-shard"
                raise ConfigError(
                    f"topology: {flag} {given} does not divide the {dp} data-parallel ranks (world "
                    f"{world_size} / tp {tp} / pp {pp}). Give a {flag} that divides {dp}, or other --tp/--pp."
                )
        return Topology(world_size=world_size, dp_replicate=rep, dp_shard=shard, tp=tp, pp=pp)

    @classmethod
    def check(cls, world_size: int, config: StrategyConfig) -> None:
        """Raise :class:`ConfigError` when this strategy cannot run with ``world_size`` and ``config``."""
        topo = cls.topology_for(world_size, config)
        cls.check_topology(topo, config)
        cls.check_comm_algorithm(config.comm_algorithm)

    @classmethod
    def check_comm_algorithm(cls, algorithm: str) -> None:
        """Refuse a ``--comm-algorithm`` this strategy does not implement, instead of ignoring it."""
        if algorithm in cls.comm_algorithms:
            return
        from paratrain.parallel.registry import strategies_taking  # the registry imports this module

        takes = " or ".join(repr(a) for a in cls.comm_algorithms)
        able = strategies_taking(algorithm)
        where = f"Strategies that take {algorithm!r}: {', '.join(able)}." if able else "No strategy takes it."
        raise ConfigError(
            f"strategy {cls.name}: --comm-algorithm {algorithm!r} is not available; {cls.name} takes {takes}"
            f"{' (' + cls.comm_algorithms_help + ')' if cls.comm_algorithms_help else ''}. {where}"
        )

    @classmethod
    def check_topology(cls, topology: Topology, config: StrategyConfig) -> None:
        """Refuse degrees the strategy does not implement (subclasses widen this)."""
        if topology.tp > 1 or topology.pp > 1:
            raise ConfigError(
                f"strategy {cls.name!r} is data parallel only, but --tp {topology.tp} --pp {topology.pp} were "
                "given. Use --strategy tp, fsdp+tp, pp, fsdp+pp or fsdp+tp+pp for model parallelism."
            )
        if cls.shard_axis_only and topology.dp_replicate > 1:
            given = (
                f"--dp-replicate {config.dp_replicate}"
                if config.dp_replicate is not None
                else f"--dp-shard {config.dp_shard}"
            )
            raise ConfigError(
                f"strategy {cls.name!r} shards over all {topology.dp_size} data-parallel ranks, but {given} "
                f"splits them into {topology.dp_replicate} replicas of {topology.dp_shard}, which {cls.name} "
                "would never average (each replica would train on its own data). Leave out --dp-replicate/"
                "--dp-shard, or, to shard within groups and replicate across them, use --strategy hsdp "
                f"--dp-replicate {topology.dp_replicate}."
            )
        if topology.dp_shard > 1 and cls.dp_degrees(topology.dp_size, config)[1] == 1:
            raise ConfigError(
                f"strategy {cls.name!r} replicates the model; --dp-shard {topology.dp_shard} needs a sharded "
                "strategy (zero1, zero2, zero3, hsdp)."
            )

    @classmethod
    def check_model(cls, model: nn.Module, world_size: int, config: StrategyConfig) -> None:
        """Checks that need the model (built on the meta device): head counts against the TP degree, layers
        against the PP degree. Raises :class:`ConfigError`."""

    @classmethod
    def data_parallel_size(cls, world_size: int, config: StrategyConfig) -> int:
        """How many ranks see different data (the global batch is split over these)."""
        return cls.topology_for(world_size, config).dp_size

    # ---- applied in every worker, in parallelize()'s order -------------------------------------------
    def apply_tensor_parallel(self, model: nn.Module) -> nn.Module:
        """Shard the model's layers over the ``tp`` axis (strategies with ``tp > 1``); the model is on its
        device already."""
        return model

    def batchnorm_group(self) -> dist.ProcessGroup | None:
        """The ranks SyncBatchNorm reduces its statistics over: the data-parallel ones."""
        return self.dp_group

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        return model.to(self.ctx.device), optimizer

    def forward_backward(
        self, model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Any, micro_batches: int
    ) -> torch.Tensor:
        """Forward and backward of one optimizer step's ``micro_batches`` micro-batches; the mean loss.

        Gradients are synchronised on the last micro-batch only (the others run under :meth:`no_sync`);
        each loss is divided by ``micro_batches`` so that the accumulated gradient is the batch mean.
        """
        total = torch.zeros((), device=self.ctx.device)
        parts = batch.split(micro_batches)
        for k, mb in enumerate(parts):
            sync = contextlib.nullcontext() if k == len(parts) - 1 else self.no_sync(model)
            with sync:
                with precision.autocast():
                    loss = loss_fn(model(mb.inputs), mb.targets)
                precision.backward(loss / micro_batches)
            total += loss.detach()
        return total / micro_batches

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context in which backward does not synchronise gradients (accumulation micro-steps)."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to a global L2 norm. Replicated gradients: the local norm *is* the global norm."""
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def eval_group(self) -> dist.ProcessGroup | None:
        """The ranks evaluation sums are all-reduced over (each sample counted once)."""
        return self.dp_group

    def evaluate_forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        """Model output for evaluation (a pipeline returns it on the last stage only, ``None`` elsewhere)."""
        return model(inputs)

    # ---- data-parallel coordinates -----------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        c = self.topology.coordinates(self.ctx.rank) if self.ctx.world_size > 1 else None
        return 0 if c is None else c["dp_replicate"] * self.topology.dp_shard + c["dp_shard"]

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The ranks that see different data (``None``: every rank, the default group)."""
        if self.topology.dp_size == self.topology.world_size or not self.ctx.distributed:
            return None
        if self._dp_group is None:
            self._dp_group = self.axis_group(("dp_replicate", "dp_shard"))
        return self._dp_group

    def axis_group(self, axes: Sequence[str]) -> dist.ProcessGroup | None:
        """The process group over ``axes`` of the run's mesh (flattened when several)."""
        if self.mesh is None:
            return None
        present = tuple(a for a in axes if a in (self.mesh.mesh_dim_names or ()))
        if not present:
            return None
        if len(present) == 1:
            return self.mesh.get_group(present[0])
        return self.mesh[present]._flatten("_".join(present)).get_group()

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside any wrapper."""
        return model
