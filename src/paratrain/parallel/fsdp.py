"""``zero3`` (alias ``fsdp``) and ``hsdp``: fully sharded data parallel with PyTorch FSDP2 (``fully_shard``).

ZeRO stage 3 (Rajbhandari et al., 2020, https://arxiv.org/abs/1910.02054) shards parameters, gradients
and optimizer state: a rank holds 16Ψ/N bytes of fp32 Adam model state. paratrain applies FSDP2
(https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html) the way torchtitan does:

- **Shard units** are wrapped bottom-up: every module of ``strategy.shard_units`` (by default each of
  ``model.blocks``, i.e. one per transformer / residual / conv block), then the root, which picks up the
  remaining parameters (stem, head). With ``blocks``, a model exposing untied input and output embeddings
  (Hugging Face's ``get_input_embeddings``/``get_output_embeddings``) gets the embedding as a unit of its own
  and the final norm with the head as one more, as Accelerate's FSDP2 preparation does, so the
  vocabulary-sized matrices are not gathered with the root and the root is left with no parameters (no
  collective of its own) (:func:`embedding_units`). Each unit's parameters become DTensors sharded along dim 0 over the mesh's
  ``dp_shard`` axis.
- **Communication schedule, per unit.** Forward: all-gather the unit's parameters just before its
  forward (FSDP2 prefetches the next unit's all-gather while this one computes), free them after it
  (``reshard_after_forward``; the root keeps its own). Backward: all-gather again, compute gradients,
  free the parameters, reduce-scatter the gradients (async; the next unit's backward overlaps it). Each
  rank keeps its 1/N shard of the mean gradient. ``optimizer.step()`` touches only local shards, with no
  communication. Per step and rank: 2 all-gathers + 1 reduce-scatter = 3Ψ (ZeRO paper, section 7).
- **HSDP** (hybrid sharding) lays the ranks on a 2-D mesh ``("dp_replicate", "dp_shard")``: parameters are
  sharded within each group of ``--shard-size`` ranks and replicated across groups. After the
  reduce-scatter inside a group, the gradient shard is all-reduced across the ``dp_replicate`` axis. Put
  ``dp_shard`` on a fast interconnect (a node) and ``dp_replicate`` across nodes.
- **Mixed precision** (``strategy.mixed_precision = "bf16"``): FSDP2 ``MixedPrecisionPolicy`` all-gathers
  and computes in bf16 and reduce-scatters gradients in bf16, while the sharded master weights and the
  optimizer state stay fp32.
- **CPU offload** (``--offload``): ``CPUOffloadPolicy`` keeps sharded parameters, gradients and optimizer
  state on the CPU; the all-gather copies a unit to the device just in time and the optimizer steps on
  the CPU.
- **Gradient accumulation**: ``set_requires_gradient_sync(False)`` on the micro-steps before the last, so
  gradients accumulate unsharded locally and are reduced once.

FSDP2 runs on Gloo too (it issues ``reduce_scatter_single``/``all_gather_single``, which Gloo implements in
torch 2.13), so every CPU test runs the real thing.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.parallel.grads import accumulation_sync, clip_grad_norm
from paratrain.parallel.optim import parameter_names, rebind_optimizer
from paratrain.parallel.parallelize import model_blocks
from paratrain.parallel.registry import register_strategy
from paratrain.parallel.strategy import Strategy, to_device


def shard_units(model: nn.Module, spec: str) -> list[nn.Module]:
    """Modules to wrap as their own FSDP unit before the root, per ``strategy.shard_units``."""
    spec = spec.strip()
    if spec == "root":
        return []
    if spec == "blocks":
        blocks = model_blocks(model)
        if blocks is None:
            raise ConfigError(
                f"strategy.shard_units='blocks' needs model.blocks or model.layers; {type(model).__name__} "
                "has neither. Name the units (--set strategy.shard_units=layer1,layer2) or use 'root'."
            )
        return blocks
    named = dict(model.named_modules())
    units = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name not in named or name == "":
            choices = [n for n in named if n and n.count(".") <= 1][:20]
            raise ConfigError(
                f"strategy.shard_units: the model has no submodule {name!r}. Submodules include: "
                f"{', '.join(choices)}."
            )
        units.append(named[name])
    return units


def final_norm(model: nn.Module) -> nn.Module | None:
    """The norm applied just before the output head of a Hugging Face model: the last direct child of its base
    model (``base_model_prefix``: ``model.norm`` of Llama/Qwen/Mistral, ``transformer.ln_f`` of GPT-2) whose
    class name contains ``Norm`` and which holds parameters; ``None`` when there is none."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(base, nn.Module):
        return None
    norm = None
    for child in base.children():
        if "Norm" in type(child).__name__ and any(True for _ in child.parameters()):
            norm = child
    return norm


def embedding_units(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """``([input embedding], [final norm, output head])`` of a model that exposes them
    (``get_input_embeddings`` and ``get_output_embeddings``, as Hugging Face models do) with untied weights,
    else ``([], [])``. The second list is one FSDP unit (a group of modules), the norm included when
    :func:`final_norm` finds it.

    Wrapped as their own units, the embedding table is gathered only around the first layer's forward and
    backward, and the head from the end of forward to the start of backward, instead of both staying in the
    root unit, which gathers them (a vocabulary-sized pair of matrices) before forward and again before
    backward. The final norm runs just before the head: in the head's unit it costs no all-gather and
    reduce-scatter of its own, and the root is left without parameters. Tied weights stay in the root: one
    parameter cannot belong to two units."""
    get_in, get_out = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    if not callable(get_in) or not callable(get_out):
        return [], []
    inp, out = get_in(), get_out()
    if not isinstance(inp, nn.Module) or not isinstance(out, nn.Module):
        return [], []
    w_in, w_out = getattr(inp, "weight", None), getattr(out, "weight", None)
    if w_in is None or w_out is None or w_in is w_out:
        return [], []
    norm = final_norm(model)
    return [inp], ([norm] if norm is not None else []) + [out]


class _FullyShard(Strategy):
    """FSDP2 over the ``dp_shard`` axis (``zero3``) or the 2-D ``(dp_replicate, dp_shard)`` sub-mesh (``hsdp``)."""

    reshard_after_forward = True

    fsdp_axes: ClassVar[str | tuple[str, ...]] = "dp_shard"
    """The axes of the run's mesh FSDP2 shards over (a 2-D sub-mesh makes it HSDP)."""

    def _policies(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        if self.config.mixed_precision == "bf16":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        else:
            mp = MixedPrecisionPolicy()
        offload = (
            CPUOffloadPolicy(pin_memory=self.ctx.device.type == "cuda")
            if self.config.offload
            else OffloadPolicy()
        )
        return {"mp_policy": mp, "offload_policy": offload}

    def _dp_mesh(self) -> Any:
        """FSDP2's mesh: the ``dp_shard`` axis (zero3), or ``(dp_replicate, dp_shard)`` (hsdp)."""
        assert self.mesh is not None, "build the strategy with build_strategy(): FSDP2 needs the run's mesh"
        return self.mesh[self.fsdp_axes]

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
        from torch.distributed.fsdp import fully_shard

        names = parameter_names(model)
        model = to_device(model, self.ctx.device)
        kw = dict(mesh=self._dp_mesh(), **self._policies())
        units = shard_units(model, self.config.shard_units)
        embed, head = embedding_units(model) if self.config.shard_units.strip() == "blocks" else ([], [])
        for unit in embed + units:  # bottom-up: units first, root last
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **kw)
        if head:  # used last in forward, first in backward: kept gathered in between
            fully_shard(head, reshard_after_forward=False, **kw)
        fully_shard(model, reshard_after_forward=self.reshard_after_forward, **kw)
        return model, rebind_optimizer(optimizer, names, model)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        return accumulation_sync(model, self.config.shard_accumulated_grads)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to the global L2 norm: the local shards' squares, summed over the axes each gradient is sharded
        on (``dp_shard``; ``dp_replicate`` holds identical, already all-reduced values)."""
        return clip_grad_norm(model.parameters(), max_norm, self.ctx.device)


@register_strategy("zero3")
class Zero3(_FullyShard):
    """FSDP2 over every data-parallel rank, one unit per block."""


@register_strategy("hsdp")
class HSDP(_FullyShard):
    """FSDP2 within shard groups, replicated across them (a 2-D sub-mesh)."""

    fsdp_axes = ("dp_replicate", "dp_shard")
