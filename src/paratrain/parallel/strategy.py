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
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import StrategyConfig
from paratrain.parallel.topology import Topology
from paratrain.runtime import Context
from paratrain.spec.presets import resolve as spec_resolve
from paratrain.spec.refusals import check as spec_check
from paratrain.spec.strategies import StrategySpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from paratrain.data.batch import Batch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def has_meta_parameters(model: nn.Module) -> bool:
    """Whether ``model`` was built with its parameters on the meta device (weights read after the split)."""
    return any(p.device.type == "meta" for p in model.parameters())


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)``, except for a model whose parameters are still on the meta device: it is
    allocated later, already split (:func:`paratrain.parallel.parallelize.materialize_deferred`)."""
    return model if has_meta_parameters(model) else model.to(device)


class Strategy:
    """Base class. A subclass registers under a spec name (:func:`~paratrain.parallel.registry.register_strategy`)
    and overrides :meth:`wrap`; its preset, capabilities and refusals are the spec's
    (:data:`paratrain.spec.strategies.STRATEGIES`), copied onto the class attributes below at registration."""

    name: ClassVar[str] = ""
    spec: ClassVar[StrategySpec]
    """The strategy's description: preset, capabilities, refusals (:mod:`paratrain.spec.strategies`)."""
    description: ClassVar[str] = ""
    supports_offload: ClassVar[bool] = False
    supports_mixed_precision: ClassVar[bool] = False
    uses_shard_size: ClassVar[bool] = False
    shard_axis_only: ClassVar[bool] = False
    uses_tp: ClassVar[bool] = False
    uses_pp: ClassVar[bool] = False
    uses_fsdp: ClassVar[bool] = False
    uses_ep: ClassVar[bool] = False
    required_axes: ClassVar[tuple[str, ...]] = ()
    comm_algorithms: ClassVar[tuple[str, ...]] = ("native",)
    # ---- behaviour of the implementation (not part of the spec) ---------------------------------------
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
    def topology_for(cls, world_size: int, config: StrategyConfig, gpus_per_node: int | None = None) -> Topology:
        """The run's topology (:func:`paratrain.spec.presets.resolve`). ``gpus_per_node`` defaults to the
        launcher's ``LOCAL_WORLD_SIZE`` (one node without it). Raises :class:`ConfigError`."""
        return spec_resolve(cls.name, world_size, config, gpus_per_node or _local_world(world_size))

    @classmethod
    def check(cls, world_size: int, config: StrategyConfig, gpus_per_node: int | None = None) -> None:
        """Raise :class:`ConfigError` when this strategy cannot run with ``world_size`` and ``config``
        (:func:`paratrain.spec.refusals.check`)."""
        spec_check(cls.name, world_size, config, gpus_per_node or _local_world(world_size))

    @classmethod
    def check_model(cls, model: nn.Module, world_size: int, config: StrategyConfig) -> None:
        """Checks that need the model (built on the meta device): head counts against the TP degree, layers
        against the PP degree. Raises :class:`ConfigError`."""

    @classmethod
    def data_parallel_size(cls, world_size: int, config: StrategyConfig, gpus_per_node: int | None = None) -> int:
        """How many ranks see different data (the global batch is split over these)."""
        return cls.topology_for(world_size, config, gpus_per_node).dp_size

    @classmethod
    def materializes_after_wrap(cls) -> bool:
        """Whether a model built on the meta device is allocated after :meth:`wrap` (which shards it with
        FSDP2, so each rank allocates its shard only) rather than before (replicating wraps broadcast and
        hook real tensors): the strategies that shard parameters with FSDP2."""
        return cls.uses_fsdp

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

    @property
    def moe_group(self) -> dist.ProcessGroup | None:
        """The ranks that route different tokens, over which an MoE model's expert counts are summed at each
        optimizer step (:func:`paratrain.models.moe.after_optimizer_step`): the data-parallel ones, and the
        ``tp`` ranks too where MoE blocks run sequence-parallel (``fsdp+tp+ep``)."""
        if not self.uses_ep or self.topology.tp == 1:
            return self.dp_group
        if self.topology.pp == 1 or not self.ctx.distributed:
            return None
        return self.axis_group(("dp_replicate", "dp_shard", "tp"))

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


def _local_world(world_size: int) -> int:
    """Ranks per node: torchrun's ``LOCAL_WORLD_SIZE``, else one node of ``world_size``."""
    try:
        return max(1, min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
    except ValueError:
        return world_size
