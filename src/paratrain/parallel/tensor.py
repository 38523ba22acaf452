"""``tp`` and ``fsdp+tp``: Megatron-style tensor parallelism with DTensor, alone or under FSDP2 (2-D).

**Layout.** The run's mesh is ``pp x dp_replicate x dp_shard x tp`` with ``tp`` innermost: the ``tp`` ranks
are consecutive, so on a GPU cluster they share a node and its fast links, because tensor parallelism
communicates inside every layer. ``fsdp+tp`` is the 2-D recipe of the PyTorch FSDP+TP tutorial: TP inside a node, FSDP2 over
the data-parallel ranks across nodes. Each parameter is then a 2-D DTensor: sharded by columns or rows over
``tp`` (the TP plan) and by dim-0 chunks of its local shard over ``dp_shard`` (FSDP2).

**The plan** comes from the model (its :class:`~paratrain.models.spec.ModelSpec`) or from the user
(``paratrain.setup(model, opt, strategy="tp", tp_plan=...)``: a ``{module name: ParallelStyle}`` dict or a
function ``(model, sequence_parallel, loss_parallel) -> dict``); it is applied with ``parallelize_module``
over ``mesh["tp"]`` (https://pytorch.org/docs/stable/distributed.tensor.parallel.html).

**Communication schedule of one step**, per transformer block, with sequence parallelism (default):
1. forward: all-gather of the normed activations (``b*s*h``) over ``tp`` before attention and before the
   MLP; reduce-scatter of the ``wo`` and ``w2`` outputs along the sequence: 2 all-gathers + 2
   reduce-scatters of ``b*s*h`` per layer, blocking (each is needed by the next matmul). Without sequence
   parallelism: one all-reduce after ``wo`` and one after ``w2``. Embedding: one reduce-scatter (or
   all-reduce); head: one all-gather of the input sequence, and of the logits unless loss-parallel;
2. backward: the mirror image (each all-gather becomes a reduce-scatter and the reverse); the norm weights'
   gradients (replicated parameters used on a sequence shard) are all-reduced over ``tp``;
3. ``tp``: gradients of the data-parallel replicas are all-reduced over ``dp_replicate`` after the last
   micro-batch (one all-reduce per ``bucket_cap_mb`` bucket, all launched, then waited);
   ``fsdp+tp``: FSDP2's per-unit all-gathers over ``dp_shard`` in forward and backward and a
   reduce-scatter of the gradients (see :mod:`paratrain.parallel.fsdp`);
4. clipping: the squared norm of the local shards, all-reduced over each axis the gradient is sharded on
   (:func:`clip_grad_norm`).

Loss parallel (``--loss-parallel``): the head keeps its logits sharded by vocabulary and the cross-entropy
runs inside ``torch.distributed.tensor.parallel.loss_parallel()`` (a max, a sum-exp and the target logit,
each all-reduced over ``tp``), never materialising ``b*s*V`` logits on one rank.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.models.spec import expert_layers, spec_of
from paratrain.parallel.grads import (
    accumulation_sync,
    align_grads,
    all_reduce_replicas,
    clip_grad_norm,
    replicated_value,
    to_local,
)
from paratrain.parallel.optim import parameter_names, rebind_optimizer
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import LossFn, Strategy, to_device
from paratrain.spec.capabilities import no_tp_plan

if TYPE_CHECKING:
    from paratrain.data.batch import Batch

TPPlan = dict[str, Any] | Callable[[nn.Module, bool, bool], dict[str, Any]]
"""A TP plan: ``{module name: ParallelStyle}``, or a function ``(model, sequence_parallel, loss_parallel)``
returning one."""


# ---- the plan -------------------------------------------------------------------------------------------
def model_tp_plan(
    model: nn.Module, config: StrategyConfig, user_plan: TPPlan | None = None
) -> dict[str, Any]:
    """The plan for ``model``: the user's (dict or function), else the one its model spec carries."""
    sp, lp = config.sequence_parallel, config.loss_parallel
    if user_plan is not None:
        return dict(user_plan(model, sp, lp) if callable(user_plan) else user_plan)
    spec = spec_of(model)
    if spec is None or spec.tp_plan is None:
        raise ConfigError(
            f"model {type(model).__name__} has no tensor-parallel plan. Pass one: paratrain.setup(model, "
            "optimizer, strategy='tp', tp_plan={'layers.0.attention.wq': ColwiseParallel(), ...}), or use a "
            "model whose spec carries one (paratrain strategies lists them; the Llama models have one)."
        )
    return dict(spec.tp_plan(model, sp, lp))


def check_model_tp(model: nn.Module, tp: int, ranks: int | None = None) -> None:
    """Launch-time check (meta model): the model's spec has a TP plan and its own check passes."""
    spec = spec_of(model)
    if spec is not None and spec.tp_plan is None and spec.check_tp is not None:
        spec.check_tp(model, tp, ranks)  # a family without a plan may refuse in its own words
    if spec is None or spec.tp_plan is None:
        family = f" (model family {spec.family!r})" if spec is not None else ""
        raise ConfigError(no_tp_plan(f"{type(model).__name__}{family}"))
    if spec.check_tp is not None:
        spec.check_tp(model, tp, ranks)


# ---- the shared base of every model-parallel preset --------------------------------------------------------
class ModelParallel(Strategy):
    """Presets that split the model (``tp``, ``fsdp+tp``, ``pp``, ``fsdp+pp``, ``fsdp+tp+pp``).

    The mesh always has the four axes (degree 1 included), so every group the step needs exists.
    Data-parallel ranks left over replicate (``tp``, ``pp``) or shard with FSDP2 (``fsdp+*``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.user_tp_plan: TPPlan | None = None
        """A plan given to :func:`paratrain.setup` (``tp_plan=``); otherwise the model's own is used."""
        self._names_before_tp: dict[int, str] = {}

    def parameter_names(self, model: nn.Module) -> dict[int, str]:
        """``id -> name`` of the model's parameters now and before tensor parallelism replaced them."""
        return {**self._names_before_tp, **parameter_names(model)}

    @classmethod
    def check_model(cls, model: nn.Module, world_size: int, config: StrategyConfig) -> None:
        topo = cls.topology_for(world_size, config)
        if cls.uses_tp and topo.tp > 1:
            cls.check_experts_tp(model)
            check_model_tp(model, topo.tp, world_size // topo.pp)

    @classmethod
    def check_experts_tp(cls, model: nn.Module) -> None:
        """An MoE model under tensor parallelism needs a strategy that splits its experts (``fsdp+tp+ep``):
        the TP plan runs MoE blocks sequence-parallel and leaves the experts to ``ep``."""
        layers = expert_layers(model)
        if layers and not cls.uses_ep:
            n = layers[0].n_experts
            raise ConfigError(
                f"strategy {cls.name!r} does not split MoE layers (model.n_experts={n}): under tensor parallelism "
                "the experts are split over an ep axis. Use --strategy fsdp+tp+ep, or fsdp+ep / ep without tp, "
                "or a data-parallel strategy (ddp, zero3)."
            )

    # ---- groups --------------------------------------------------------------------------------------
    def group(self, axis: str) -> Any:
        """The process group of one mesh axis (this rank's row along it)."""
        assert self.mesh is not None, "build the strategy with build_strategy(): it needs the run's mesh"
        return self.mesh.get_group(axis)

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        if not self.ctx.distributed or self.mesh is None:
            return None
        if self._dp_group is None:
            self._dp_group = self.axis_group(("dp_replicate", "dp_shard"))
        return self._dp_group

    # ---- transforms ----------------------------------------------------------------------------------
    def apply_tensor_parallel(self, model: nn.Module) -> nn.Module:
        if not self.uses_tp or (self.topology.tp == 1 and self.user_tp_plan is None):
            return model
        from torch.distributed.tensor.parallel import parallelize_module

        assert self.mesh is not None
        self.check_experts_tp(model)
        if self.user_tp_plan is None:  # first: a family without a plan refuses in its own words
            check_model_tp(model, self.topology.tp)
        plan = model_tp_plan(model, self.config, self.user_tp_plan)
        # parallelize_module swaps parameters for DTensors: remember the names of the originals, so that an
        # optimizer built before (paratrain.setup) can be rebound by name in wrap()
        self._names_before_tp.update(parameter_names(model))
        parallelize_module(model, self.mesh["tp"], plan)
        return model

    def fsdp_mesh(self) -> Any:
        assert self.mesh is not None
        axes = ("dp_replicate", "dp_shard") if self.topology.dp_replicate > 1 else "dp_shard"
        return self.mesh[axes]

    def fully_shard(self, units: list[nn.Module], roots: list[nn.Module]) -> None:
        """FSDP2 over the data-parallel sub-mesh: ``units`` first (bottom-up), then each of ``roots``."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            if self.config.mixed_precision == "bf16"
            else MixedPrecisionPolicy()
        )
        mesh = self.fsdp_mesh()
        # A root whose output is the TP head's logits returns a view of a DTensor's local shard; FSDP2 warns
        # about in-place ops on such views, and the loss functions use the logits out of place only.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        for m in units:
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        for m in roots:
            fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward=True)

    # ---- the step ------------------------------------------------------------------------------------
    def loss_context(self) -> contextlib.AbstractContextManager[None]:
        """``loss_parallel()`` when the logits are vocabulary-sharded DTensors."""
        if self.config.loss_parallel and self.topology.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def sync_replicas(self, model: nn.Module) -> None:
        """``dp_replicate`` without FSDP: average the gradients over the replicas (after the last micro-batch)."""
        if not self.uses_fsdp and self.topology.dp_replicate > 1:
            bucket = int(self.config.bucket_cap_mb * 2**20)
            all_reduce_replicas(model.parameters(), self.group("dp_replicate"), bucket)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(model.parameters(), max_norm, self.ctx.device)


class _TensorParallel(ModelParallel):
    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        model = to_device(model, self.ctx.device)
        names = self.parameter_names(model)
        if self.uses_fsdp:
            from paratrain.parallel.fsdp import shard_units

            self.fully_shard(shard_units(model, self.config.shard_units), [model])
        return model, rebind_optimizer(optimizer, names, model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if not self.uses_fsdp:
            return contextlib.nullcontext()
        return accumulation_sync(model, self.config.shard_accumulated_grads)

    def forward_backward(
        self, model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Any, micro_batches: int
    ) -> torch.Tensor:
        """Micro-batches as in the base class, inside ``loss_parallel()`` when on; then the replicas' gradients
        are averaged (``tp`` with ``dp_replicate > 1``; FSDP2 reduce-scatters in backward by itself)."""
        total = torch.zeros((), device=self.ctx.device)
        parts = batch.split(micro_batches)
        for k, mb in enumerate(parts):
            sync = contextlib.nullcontext() if k == len(parts) - 1 else self.no_sync(model)
            with sync, self.loss_context():
                with precision.autocast():
                    loss = loss_fn(model(mb.inputs), mb.targets)
                precision.backward(loss / micro_batches)
            total += to_local(loss.detach())
        if not self.uses_fsdp:  # FSDP2 brings gradients to their parameter's layout in its reduce-scatter
            align_grads(model.parameters())
        self.sync_replicas(model)
        return total / micro_batches

    def evaluate_forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        return replicated_value(model(inputs))  # vocabulary-sharded logits (loss parallel) are gathered


@register_strategy("tp")
class TensorParallel(_TensorParallel):
    """Megatron tensor parallelism; the data-parallel ranks left over are replicas."""


@register_strategy("fsdp+tp")
class FSDPTensorParallel(_TensorParallel):
    """Tensor parallelism inside a node, FSDP2 over the data-parallel ranks."""
