"""``fsdp+ep+pp``: pipeline stages (as ``fsdp+pp``, :mod:`paratrain.parallel.pipeline`), each an ``fsdp+ep``
layout (:mod:`paratrain.parallel.expert`).

**Layout.** The ``pp`` axis is outermost: a stage's ranks are ``world / pp`` consecutive ones. Inside a stage
the dense blocks are FSDP2-sharded over the stage's data-parallel ranks, and each MoE layer's experts are
split over ``ep`` of them (consecutive ranks of the stage) and FSDP2-sharded over the ``edp = dp / ep`` left;
the experts' mesh is ``("pp", "edp", "ep")`` over the run's ranks, so every ``ep`` and ``edp`` group lies
inside one stage. A stage holds only its own layers' experts, each a DTensor ``Shard(0)`` of the stacked
``[E, ...]`` weight under its original name: checkpoints store experts by global index, as under ``fsdp+ep``.

**Communication schedule of one step.** The pipeline schedule runs as in ``fsdp+pp`` (activations and their
gradients over ``pp``; FSDP2's all-gathers and reduce-scatters per stage). Each MoE layer's forward and
backward run the two all-to-alls of :class:`~paratrain.parallel.expert.ExpertDispatch` in the stage's ``ep``
group; the ranks of a stage run the same schedule, so their all-to-alls pair up in the same order, also in
the forward and backward torch runs at the first step to infer the stage's shapes (with the MoE layers in
eval mode, so that placeholder tokens count nowhere). Then:

1. expert gradients, already summed over the ep group's tokens by the all-to-all's backward and averaged over
   ``edp`` by FSDP2, are scaled by ``edp / dp`` (the mean over the stage's data-parallel ranks);
2. the expert-bias token counts are summed over the stage's data-parallel ranks (:attr:`moe_group`: each
   stage counts its own layers);
3. clipping: squares of dense shards all-reduced over ``dp``, of expert shards over ``edp`` and ``ep``, then
   the total over ``pp`` (stages hold disjoint parameters), equal to the single-process norm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.models.spec import expert_layers
from paratrain.parallel.expert import _ExpertParallel
from paratrain.parallel.optim import parameter_names
from paratrain.parallel.pipeline import _Pipeline
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import LossFn, to_device

if TYPE_CHECKING:
    from paratrain.data.batch import Batch


@register_strategy("fsdp+ep+pp")
class FSDPExpertPipelineParallel(_Pipeline, _ExpertParallel):
    """Pipeline stages, each FSDP2 over its data-parallel ranks with the experts split over ``ep`` of them."""

    @classmethod
    def check_model(cls, model: nn.Module, world_size: int, config: StrategyConfig) -> None:
        super().check_model(model, world_size, config)
        layers = expert_layers(model)
        if layers and layers[0].aux_loss_coef > 0:
            raise ConfigError(
                f"model.aux_loss_coef={layers[0].aux_loss_coef}: under {cls.name} only the last stage computes "
                "the loss, so the balance loss of the other stages' MoE layers would be lost. Use the loss-free "
                "expert bias (model.aux_loss_coef=0, model.bias_update_rate > 0), or --strategy fsdp+ep."
            )

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        """The experts first, each layer's its own FSDP2 unit over ``edp``; then the stages as ``fsdp+pp``."""
        from torch.distributed.fsdp import fully_shard

        model = to_device(model, self.ctx.device)
        assert self.expert_mesh is not None
        # an optimizer built over the expert DTensors is rebound by name after FSDP2 replaced them
        self._names_before_tp.update(parameter_names(model))
        for moe in expert_layers(model):
            fully_shard(moe.experts, mesh=self.expert_mesh["edp"], reshard_after_forward=True)
        return _Pipeline.wrap(self, model, optimizer)

    def forward_backward(
        self, model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Any, micro_batches: int
    ) -> torch.Tensor:
        loss = _Pipeline.forward_backward(self, model, batch, loss_fn, precision, micro_batches)
        self.scale_expert_gradients(model)
        return loss
