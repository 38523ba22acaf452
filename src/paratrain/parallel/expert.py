"""``ep``, ``fsdp+ep`` and ``fsdp+tp+ep``: expert parallelism for mixture-of-experts models.

**Layout** (torchtitan's dp2ep). The dense part of the model (attention, norms, router, shared expert,
embeddings) is laid out as usual over the data-parallel ranks: replicated (``ep``) or sharded by FSDP2
(``fsdp+ep``). The routed experts are split by expert over an ``ep`` axis that *borrows* ranks from those
data-parallel ranks: each group of ``ep`` consecutive ranks holds one copy of every expert, ``n_experts / ep``
on each rank, as DTensors ``Shard(0)`` of the stacked ``[E, ...]`` weights (so a checkpoint stores each expert
under its original name and global index, and DCP reshards it to any ``ep``). The ranks left over, ``edp =
world / ep``, hold copies of the same expert shard: replicated (``ep``), or sharded further by FSDP2 over
``edp`` (``fsdp+ep``). The experts' mesh is its own 2-D DeviceMesh ``("edp", "ep")`` over the same ranks.

**Communication schedule of one MoE layer**, forward (each rank routes its own tokens):

1. the router picks ``top_k`` experts per token; the assignments are sorted, stably, into expert-major
   order (the model's own routing tables), so the rows for the experts of ep rank ``j`` are one
   contiguous block;
2. the rows per (destination rank, expert) are exchanged first: an all-to-all of ``n_experts`` integers;
3. dispatch: ``all_to_all_single`` with uneven splits sends each block to the rank owning its experts
   (``--comm-algorithm native``), or paratrain's pairwise send/recv exchange (``pairwise``,
   :func:`paratrain.comm.all_to_all`); a rank whose experts receive no token takes part with empty blocks;
4. the received rows (source-major) are permuted, stably, into local-expert-major order, computed by the
   grouped GEMM, and permuted back;
5. combine: the reverse all-to-all returns each row to its token's rank, where the ``top_k`` outputs are
   summed with the router's weights in slot order (deterministic; no scatter-add).

Backward runs the same two all-to-alls in reverse (the gradient of an all-to-all is the all-to-all with
the splits swapped). Volume per MoE layer and direction: ``top_k * tokens * dim * (ep - 1) / ep`` elements
per rank each way, forward and backward.

**Gradients.** Each rank's loss is the mean over its own tokens, and the global objective is the mean over
the ``world`` ranks. An expert's gradient on a rank already sums, through the all-to-all's backward, the
contributions of the tokens of its ``ep`` group; ``ep`` then sums it over the ``edp`` copies (one all-reduce)
and divides by ``world``; ``fsdp+ep`` lets FSDP2 reduce-scatter it over ``edp`` (a mean over ``edp``) and
divides the shard by ``ep``. Dense gradients are averaged over all data-parallel ranks (``ep``: bucketed all-reduces after the
last micro-batch; ``fsdp+ep``: FSDP2's reduce-scatter). Clipping takes one global norm over dense and expert
gradients together (:func:`paratrain.parallel.grads.clip_grad_norm`: squares of expert shards all-reduced
over ``ep`` and, under FSDP, ``edp``), equal to the single-process norm.

Reference: torchtitan's expert parallel (https://github.com/pytorch/torchtitan, ``torchtitan/distributed/
expert_parallel.py``); DeepSpeed-MoE (Rajbhandari et al. 2022, https://arxiv.org/abs/2201.05596).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain import comm
from paratrain.config import StrategyConfig
from paratrain.errors import ConfigError
from paratrain.models.spec import expert_layers, spec_of
from paratrain.parallel.grads import (
    accumulation_sync,
    all_reduce_replicas,
    clip_grad_norm,
    replicated_value,
    to_local,
)
from paratrain.parallel.optim import parameter_names, rebind_optimizer
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import LossFn, Strategy
from paratrain.parallel.tensor import ModelParallel, _TensorParallel
from paratrain.spec.capabilities import hf_no_ep, no_moe_layer

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from paratrain.data.batch import Batch


# ---- dispatch and combine ----------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """Rows ``send[j]`` to rank ``j``, ``recv[j]`` from rank ``j``; backward sends the gradients back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, recv: list[int], send: list[int], group: Any, algorithm: str
    ) -> torch.Tensor:
        ctx.args = (recv, send, group, algorithm)
        return comm.all_to_all(x, recv, send, algorithm=algorithm, group=group, check=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        recv, send, group, algorithm = ctx.args
        back = comm.all_to_all(grad.contiguous(), send, recv, algorithm=algorithm, group=group, check=False)
        return back, None, None, None, None


class ExpertDispatch:
    """The ``MoE.dispatcher`` of one rank: rows in global-expert-major order -> the experts' owners -> back."""

    def __init__(self, group: Any, ep: int, algorithm: str) -> None:
        self.group, self.ep, self.algorithm = group, ep, algorithm
        self.bytes_sent = 0
        """Bytes of token rows this rank sent to other ranks in forward passes (dispatch + combine); backward
        sends the same again."""

    # Run eagerly under --compile: the exchange of row counts is data-dependent (Python lists of sizes), and
    # Dynamo cannot trace paratrain's all-to-all over a process group ("unregistered member on an OpaqueObject").
    @torch.compiler.disable
    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        n_local = counts.numel() // ep
        table = counts.to(torch.int64).view(ep, n_local)  # rows for (destination rank, its local expert)
        theirs = comm.all_to_all(
            table.reshape(-1).contiguous(), [n_local] * ep, [n_local] * ep,
            algorithm=self.algorithm, group=self.group, check=False,
        ).view(ep, n_local)  # rows from (source rank, my local expert)  # fmt: skip
        send, recv = table.sum(1).tolist(), theirs.sum(1).tolist()
        me = dist.get_rank(self.group)
        self.bytes_sent += 2 * (sum(send) - send[me]) * rows.shape[1] * rows.element_size()
        got = _AllToAll.apply(rows, recv, send, self.group, self.algorithm)  # source-major
        # source-major -> local-expert-major, stable (tokens keep their source order within an expert)
        expert_of_row = torch.repeat_interleave(
            torch.arange(n_local, device=got.device).repeat(ep), theirs.reshape(-1).to(got.device)
        )
        perm = torch.argsort(expert_of_row, stable=True)
        out = experts(got[perm], theirs.sum(0))
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        return _AllToAll.apply(out[inverse], send, recv, self.group, self.algorithm)


# ---- the strategies ------------------------------------------------------------------------------------------
class _ExpertParallel(ModelParallel):
    """Experts split over ``ep`` ranks borrowed from the data-parallel ones; the dense part replicated
    (``ep``) or FSDP-sharded (``fsdp+ep``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.expert_mesh: DeviceMesh | None = None
        if self.mesh is not None:
            from torch.distributed.device_mesh import init_device_mesh

            ep, pp = self.topology.ep, self.topology.pp
            if pp == 1:
                shape = (self.topology.world_size // ep, ep)
                self.expert_mesh = init_device_mesh(self.ctx.device.type, shape, mesh_dim_names=("edp", "ep"))
            else:  # pipeline stages outermost (as in the run's mesh): edp and ep inside one stage's ranks
                shape3 = (pp, self.topology.world_size // pp // ep, ep)
                staged = init_device_mesh(self.ctx.device.type, shape3, mesh_dim_names=("pp", "edp", "ep"))
                self.expert_mesh = staged["edp", "ep"]

    # ---- checked before launch (the preset and its refusals: paratrain.spec.strategies) -------------
    @classmethod
    def check_model(cls, model: nn.Module, world_size: int, config: StrategyConfig) -> None:
        super().check_model(model, world_size, config)
        topo = cls.topology_for(world_size, config)
        check_model_experts(model, topo.ep, topo.dp_size * topo.tp)

    # ---- applied in every worker ----------------------------------------------------------------------
    def apply_tensor_parallel(self, model: nn.Module) -> nn.Module:
        """Split every MoE layer's experts over ``ep`` (before the optimizer is built) and install the
        all-to-all dispatcher."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        assert self.expert_mesh is not None, (
            "build the strategy with build_strategy(): it needs the run's mesh"
        )
        if not self.uses_pp:  # a pipeline stage may hold no MoE layer (the full model was checked before)
            check_model_experts(model, self.topology.ep)
        self._names_before_tp.update(parameter_names(model))
        mesh = self.expert_mesh["ep"] if self.uses_fsdp else self.expert_mesh
        placements = [Shard(0)] if self.uses_fsdp else [Replicate(), Shard(0)]
        ep, me = self.topology.ep, self.expert_mesh.get_local_rank("ep")
        dispatch = ExpertDispatch(self.expert_mesh.get_group("ep"), ep, self.config.comm_algorithm)
        for moe in expert_layers(model):
            experts = moe.experts
            for name, p in list(experts.named_parameters(recurse=False)):
                # every rank initialised the full stack from the same seed: keep this rank's experts
                local = p.detach().chunk(ep, dim=0)[me].contiguous()
                shard = DTensor.from_local(local, mesh, placements, run_check=False, shape=p.shape,
                                           stride=p.stride())  # fmt: skip
                experts.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
            moe.dispatcher = dispatch
        return model

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        model = model.to(self.ctx.device)
        names = self.parameter_names(model)
        if self.uses_fsdp:
            from torch.distributed.fsdp import fully_shard

            from paratrain.parallel.fsdp import shard_units

            assert self.expert_mesh is not None
            for moe in expert_layers(model):  # the experts first: their own unit, sharded further over edp
                fully_shard(moe.experts, mesh=self.expert_mesh["edp"], reshard_after_forward=True)
            self.fully_shard(shard_units(model, self.config.shard_units), [model])
        return model, rebind_optimizer(optimizer, names, model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if not self.uses_fsdp:
            return contextlib.nullcontext()
        return accumulation_sync(model, self.config.shard_accumulated_grads)

    def forward_backward(
        self, model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Any, micro_batches: int
    ) -> torch.Tensor:
        loss = Strategy.forward_backward(self, model, batch, loss_fn, precision, micro_batches)
        if not self.uses_fsdp:
            self.sync_gradients(model)
        else:
            self.scale_expert_gradients(model)
        return loss

    def scale_expert_gradients(self, model: nn.Module) -> None:
        """FSDP2's reduce-scatter over ``edp`` averaged the expert gradients (sum / edp); each was already a
        sum over its ep group's tokens, so ``edp / dp`` more makes it the mean over the data-parallel ranks
        (``1 / ep`` without tp). (FSDP2's set_gradient_divide_factor would fold this in, but it needs
        PREMUL_SUM, which Gloo lacks.)"""
        factor = (self.topology.world_size // self.topology.pp // self.topology.ep) / self.topology.dp_size
        if factor == 1:
            return
        for moe in expert_layers(model):
            for p in moe.experts.parameters():
                if p.grad is not None:
                    p.grad.to_local().mul_(factor)  # type: ignore[attr-defined]

    def sync_gradients(self, model: nn.Module) -> None:
        """``ep``: dense gradients averaged over every rank (bucketed all-reduces), expert gradients summed
        over the ``edp`` copies and divided by the number of ranks."""
        from torch.distributed.tensor import DTensor

        dense = [p for p in model.parameters() if not isinstance(p, DTensor)]
        world = self.topology.dp_size
        if world > 1:
            group = self.dp_group
            all_reduce_replicas(dense, group, int(self.config.bucket_cap_mb * 2**20))
        assert self.expert_mesh is not None
        edp = self.expert_mesh.get_group("edp")
        for p in model.parameters():
            if isinstance(p, DTensor) and p.grad is not None:
                g = p.grad.to_local()  # type: ignore[attr-defined]
                if dist.get_world_size(edp) > 1:
                    dist.all_reduce(g, group=edp)
                g.div_(world)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(model.parameters(), max_norm, self.ctx.device)


class _TensorExpertParallel(_ExpertParallel):
    """``fsdp+tp+ep``: the dense part as ``fsdp+tp`` (:mod:`paratrain.parallel.tensor`), the experts over an
    ``ep`` axis borrowed from ``dp_shard x tp``.

    The model's TP plan runs each MoE block sequence-parallel
    (Llama's: :func:`paratrain.models.llama_parallel.tp_plan`): a tp rank routes its own ``s / tp`` tokens, so every rank of ``dp_shard x tp`` routes different tokens and
    the ``ep`` groups (``ep`` consecutive ranks: the tp ranks first) exchange them like data-parallel ranks.
    The router and the shared expert are replicated over ``tp`` and see a slice of the sequence each: after
    FSDP2's reduce-scatter over ``dp_shard`` their gradient shards are summed over ``tp`` (one all-reduce
    per step). The expert gradients get ``edp / dp`` (:meth:`scale_expert_gradients`)."""

    @classmethod
    def check_model(cls, model: nn.Module, world_size: int, config: StrategyConfig) -> None:
        super().check_model(model, world_size, config)
        layers = expert_layers(model)
        if cls.topology_for(world_size, config).tp > 1 and layers and layers[0].aux_loss_coef > 0:
            raise ConfigError(
                f"model.aux_loss_coef={layers[0].aux_loss_coef}: the sequence-level balance loss needs whole "
                f"sequences, and under {cls.name} each tp rank routes a slice of each. Use the loss-free "
                "expert bias (model.aux_loss_coef=0, model.bias_update_rate > 0), or --strategy fsdp+ep."
            )

    def apply_tensor_parallel(self, model: nn.Module) -> nn.Module:
        model = ModelParallel.apply_tensor_parallel(self, model)  # the dense layers over tp
        return super().apply_tensor_parallel(model)  # then the experts over ep

    def forward_backward(
        self, model: nn.Module, batch: Batch, loss_fn: LossFn, precision: Any, micro_batches: int
    ) -> torch.Tensor:
        loss = _TensorParallel.forward_backward(self, model, batch, loss_fn, precision, micro_batches)  # type: ignore[arg-type]
        self.scale_expert_gradients(model)
        if self.topology.tp > 1:
            tp = self.group("tp")
            for moe in expert_layers(model):
                for mod in (moe.router, moe.shared_experts):
                    for p in mod.parameters() if mod is not None else ():
                        if p.grad is not None:
                            dist.all_reduce(to_local(p.grad), group=tp)
        return loss

    def evaluate_forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor | None:
        return replicated_value(model(inputs))


def check_model_experts(model: nn.Module, ep: int, ranks: int | None = None) -> None:
    """Refuse a model without MoE layers, or whose expert count ``ep`` does not divide (``ranks``: the ranks
    ``ep`` borrows from; the degrees suggested divide them too)."""
    layers = expert_layers(model)
    if not layers:
        family = str(getattr(spec_of(model), "family", ""))
        if family.startswith("hf:"):  # a transformers model: ep does not split its MoE modules
            raise ConfigError(hf_no_ep(family[3:], ep))
        raise ConfigError(no_moe_layer(type(model).__name__, ep))
    n = layers[0].n_experts
    if n % ep:
        divisors = [d for d in range(2, n + 1) if n % d == 0 and (ranks is None or ranks % d == 0)]
        fix = f"Use --ep one of {', '.join(map(str, divisors))}, or" if divisors else "Use"
        raise ConfigError(
            f"--ep {ep} does not divide the model's {n} experts (model.n_experts={n}): each ep rank holds an "
            f"equal share. {fix} a model.n_experts that --ep {ep} divides."
        )


@register_strategy("ep")
class ExpertParallel(_ExpertParallel):
    description = (
        "expert parallel: each MoE layer's experts split over all ranks (all-to-all), dense replicated"
    )


@register_strategy("fsdp+ep")
class FSDPExpertParallel(_ExpertParallel):
    description = "FSDP2 over the data-parallel ranks; experts split over --ep of them and FSDP over the rest"
    uses_fsdp = True
    supports_mixed_precision = True
    ep_default = "two"


@register_strategy("fsdp+tp+ep")
class FSDPTensorExpertParallel(_TensorExpertParallel):
    description = "tensor parallel and FSDP2 for the dense part; experts over --ep ranks of dp_shard x tp"
    uses_fsdp = True
    supports_mixed_precision = True


__all__ = [
    "ExpertDispatch",
    "ExpertParallel",
    "FSDPExpertParallel",
    "FSDPTensorExpertParallel",
    "check_model_experts",
]
