"""Tensor-parallel styles for the layers of ``transformers`` models that DTensor's ``ColwiseParallel`` /
``RowwiseParallel`` do not cover (used by :func:`paratrain.models.hf_parallel.tp_plan`).

- :class:`GradAllReduce`: the config's ``replicated_with_grad_allreduce`` (Qwen3's ``q_norm``/``k_norm``,
  one RMSNorm weight over ``head_dim`` shared by all heads). The weight stays a plain, replicated tensor; each
  rank normalises its local heads, so each rank's gradient is its heads' part: it is summed over the TP group
  in the backward pass (Megatron's ``f`` operator applied to the weight).
- :class:`Conv1DColwise` / :class:`Conv1DRowwise`: GPT-2's ``Conv1D`` (a linear layer with the weight stored
  ``[in, out]``): ``c_fc`` split by output columns (``Shard(1)``, its bias ``Shard(0)``), ``c_proj`` and
  ``mlp.c_proj`` by input rows (``Shard(0)``, the bias replicated, the partial outputs all-reduced).
- :class:`GPT2FusedQKV`: GPT-2's ``c_attn``, one ``[hidden, 3·hidden]`` weight holding q, k and v side by
  side. A rank's heads are three separate column blocks of it (its q, k and v columns), which no single
  DTensor shard describes and which a checkpoint in Hugging Face's layout could not store as one piece; so
  the weight stays whole (replicated over the TP group, sharded by FSDP under ``fsdp+tp``), each rank
  multiplies only by its heads' q, k, v columns, and the gradient (non-zero in those columns only) is summed
  over the group. The attention's ``split_size`` becomes the local width, so ``transformers``' forward splits
  and reshapes the local heads unchanged.

Every forward works on local tensors (``DTensor.to_local``; a ``Shard`` parameter's local gradient is its
shard's gradient), with the two collectives of Megatron-LM's tensor parallelism made explicit: identity
forward / all-reduce backward at the input of a column-split layer, all-reduce forward / identity backward at
the output of a row-split one.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["Conv1DColwise", "Conv1DRowwise", "GPT2FusedQKV", "GradAllReduce"]


class _CopyToTP(torch.autograd.Function):
    """Identity forward; the gradient summed over the TP group (the input of a column-split layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Partial outputs summed over the TP group; identity backward (the output of a row-split layer)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _local(p: torch.Tensor) -> torch.Tensor:
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p


def _distribute(module: nn.Module, mesh: Any, placements: dict[str, Any]) -> None:
    from torch.distributed.tensor import distribute_tensor

    for name, placement in placements.items():
        p = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement])))


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """GPT-2's Conv1D on local tensors: ``x @ w + b`` with ``w`` stored ``[in, out]``."""
    flat = x.reshape(-1, x.size(-1))
    out = flat @ w if b is None else torch.addmm(b, flat, w)
    return out.view(*x.shape[:-1], w.shape[1])


class GradAllReduce(ParallelStyle):
    """Parameters replicated, gradients summed over the TP group (``replicated_with_grad_allreduce``)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        forward = type(module).forward

        def tp_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            params = dict(self._parameters)
            try:
                for name, p in params.items():
                    if p is not None:
                        self._parameters[name] = _CopyToTP.apply(p, group)  # type: ignore[assignment]
                return forward(self, *args, **kwargs)
            finally:
                self._parameters.update(params)

        module.forward = types.MethodType(tp_forward, module)  # type: ignore[method-assign]
        return module


class Conv1DColwise(ParallelStyle):
    """A GPT-2 ``Conv1D`` split by output columns: weight ``Shard(1)``, bias ``Shard(0)``."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Shard

        group = device_mesh.get_group()
        _distribute(module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})

        def tp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            return _linear(_CopyToTP.apply(x, group), _local(self.weight), _local(self.bias))

        module.forward = types.MethodType(tp_forward, module)  # type: ignore[method-assign]
        return module


class Conv1DRowwise(ParallelStyle):
    """A GPT-2 ``Conv1D`` split by input rows: weight ``Shard(0)``, bias replicated, outputs all-reduced."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Replicate, Shard

        group = device_mesh.get_group()
        _distribute(module, device_mesh, {"weight": Shard(0), "bias": Replicate()})

        def tp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            out = _ReduceFromTP.apply(_linear(x, _local(self.weight), None), group)
            return out + _local(self.bias)

        module.forward = types.MethodType(tp_forward, module)  # type: ignore[method-assign]
        return module


class GPT2FusedQKV(ParallelStyle):
    """GPT-2's attention (``GPT2Attention``): ``c_attn`` computes this rank's heads only (module docstring),
    ``c_proj`` is :class:`Conv1DRowwise`."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        tp, rank = device_mesh.size(), device_mesh.get_local_rank()
        attn: Any = module
        width = int(attn.embed_dim)
        local = width // tp
        attn.split_size = local  # transformers splits q, k, v of the local width and views -1 heads
        c_attn = attn.c_attn

        def qkv_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
            w = _CopyToTP.apply(self.weight, group)
            b = _CopyToTP.apply(self.bias, group)
            w = w.view(w.shape[0], 3, tp, local)[:, :, rank].reshape(w.shape[0], 3 * local)
            b = b.view(3, tp, local)[:, rank].reshape(3 * local)
            return _linear(_CopyToTP.apply(x, group), w, b)

        c_attn.forward = types.MethodType(qkv_forward, c_attn)
        Conv1DRowwise()._apply(attn.c_proj, device_mesh)
        return module
