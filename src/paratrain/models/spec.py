"""What a model family tells the strategies: how it is split (torchtitan's ``ModelSpec``).

A strategy never names a model class. It asks :func:`spec_of` for the model's :class:`ModelSpec` and uses
what the spec provides:

- ``tp_plan(model, sequence_parallel, loss_parallel)``: ``{module name: ParallelStyle}`` for
  ``parallelize_module`` over the ``tp`` axis, and ``check_tp(model, tp, ranks)``, the launch-time check
  (heads divisible by ``tp``, ...) run on the meta model;
- ``pipeline_split(model, num_stages, stage, layers_per_stage)``: one stage as a module that keeps the
  stage's own submodules under their original names, ``check_pipeline(model, num_stages)``, and
  ``stage_blocks(stage)``: the blocks of a stage (its FSDP units under ``fsdp+pp``);
- ``fsdp_units(model)``: the blocks sharded one by one (FSDP units, activation-checkpointing and compile
  units); without it, ``model.blocks`` or ``model.layers`` are used;
- ``flops_per_token(model, seq_len)``: training FLOPs per token (forward + backward) for MFU;
- ``materialize(model, device)``: for a model whose parameters were built on the meta device (its weights
  come from files), allocate what this rank holds after the split and read it.

Mixture-of-experts blocks are found by module type, not through the model's spec: the expert-parallel
strategies also look inside a pipeline stage or a wrapper, which no model predicate matches. A family
registers its block class with :func:`register_expert_layer`; :func:`expert_layers` returns the blocks of any
module, each used only through the :class:`ExpertLayer` protocol (the routed experts' stacked weights, the
router, the shared expert and the ``dispatcher`` hook that expert parallelism sets).

A family registers its spec with :func:`register_model_spec` (the built-in families when
:mod:`paratrain.models` is imported; this module imports none of them) under a predicate on the module (usually an
``isinstance`` test written in the family's own module), or a builder attaches one to an instance
(:func:`attach_spec`), which wins: a model built at run time (a Hugging Face class, a user's factory)
carries its own plans. A missing capability is ``None``, and the strategy that needs it refuses the model
before launch, naming the model and the capability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import torch
from torch import nn

__all__ = [
    "Dispatcher",
    "ExpertLayer",
    "ModelSpec",
    "attach_spec",
    "expert_layers",
    "model_blocks",
    "register_expert_layer",
    "register_model_spec",
    "spec_of",
]

SPEC_ATTR = "_paratrain_model_spec"
"""Instance attribute holding a model's own :class:`ModelSpec` (set by :func:`attach_spec`)."""


@dataclass(frozen=True)
class ModelSpec:
    """The parallel plans of one model family; any capability may be ``None`` (not supported)."""

    family: str
    """Name used in messages (``llama``, ``hf:LlamaForCausalLM``, ...)."""
    tp_plan: Callable[[nn.Module, bool, bool], dict[str, Any]] | None = None
    """``(model, sequence_parallel, loss_parallel) -> {module name: ParallelStyle}``."""
    check_tp: Callable[[nn.Module, int, int | None], None] | None = None
    """``(meta model, tp, ranks left for tp)``: raise :class:`~paratrain.errors.ConfigError` when ``tp``
    cannot split the model."""
    pipeline_split: Callable[[nn.Module, int, int, Sequence[int] | None], nn.Module] | None = None
    """``(model, num_stages, stage, layers_per_stage) -> stage module`` sharing ``model``'s submodules."""
    check_pipeline: Callable[[nn.Module, int], None] | None = None
    """``(meta model, num_stages)``: raise :class:`~paratrain.errors.ConfigError` when it cannot be cut."""
    stage_blocks: Callable[[nn.Module], list[nn.Module]] | None = None
    """The blocks of one pipeline stage (its FSDP units)."""
    fsdp_units: Callable[[nn.Module], list[nn.Module]] | None = None
    """The blocks to shard one by one; ``None``: ``model.blocks``/``model.layers``."""
    flops_per_token: Callable[[nn.Module, int], float] | None = None
    """``(model, seq_len) -> training FLOPs per token``."""
    materialize: Callable[[nn.Module, Any], None] | None = None
    """``(model, device)``: allocate and fill the parameters of a model built with them on the meta device
    (weights loaded from files), after the strategy split and sharded it, so each rank reads what it holds."""


_ENTRIES: list[tuple[Callable[[nn.Module], bool], ModelSpec]] = []


def register_model_spec(matches: Callable[[nn.Module], bool], spec: ModelSpec) -> ModelSpec:
    """Register ``spec`` for every module ``matches`` accepts; later registrations are asked first."""
    _ENTRIES.insert(0, (matches, spec))
    return spec


def attach_spec(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """Give this one model instance its own spec (it wins over the registered ones); returns ``model``."""
    object.__setattr__(model, SPEC_ATTR, spec)
    return model


def spec_of(model: nn.Module) -> ModelSpec | None:
    """The spec of ``model``: its own (:func:`attach_spec`), else the first registered one that matches."""
    own = getattr(model, SPEC_ATTR, None)
    if isinstance(own, ModelSpec):
        return own
    for matches, spec in _ENTRIES:
        if matches(model):
            return spec
    return None


def model_blocks(model: nn.Module) -> list[nn.Module] | None:
    """The model's blocks (FSDP units, checkpointing and compile units): its spec's ``fsdp_units``, else
    ``model.blocks`` or ``model.layers`` (a ModuleList or ModuleDict); ``None`` when it has none."""
    spec = spec_of(model)
    if spec is not None and spec.fsdp_units is not None:
        return list(spec.fsdp_units(model))
    for attr in ("blocks", "layers"):
        blocks = getattr(model, attr, None)
        if isinstance(blocks, nn.ModuleList):
            return list(blocks)
        if isinstance(blocks, nn.ModuleDict):
            return list(blocks.values())
    return None


# ---------------------------------------------------------------------------------------------- experts
Dispatcher = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(experts, rows in expert-major order [N, dim], rows per global expert [E]) -> expert outputs [N, dim]``."""


class ExpertLayer(Protocol):
    """What the expert-parallel strategies use of one mixture-of-experts block (an ``nn.Module``)."""

    n_experts: int
    """Routed experts of the block (the ``ep`` degree must divide it)."""
    aux_loss_coef: float
    """Weight of the sequence-level balance loss; ``> 0`` needs whole sequences on one rank."""
    experts: nn.Module
    """The routed experts: every parameter stacked along dim 0 (``[n_experts, ...]``, split by expert
    parallelism as ``Shard(0)``); ``experts(rows, counts)`` computes rows in expert-major order."""
    router: nn.Module
    """The gate; replicated over ``tp``, its gradient summed over the tp ranks that routed sequence slices."""
    shared_experts: nn.Module | None
    """The always-on expert (replicated like the router), or ``None``."""
    dispatcher: Dispatcher | None
    """Expert parallelism's exchange, set by the strategy; ``None``: every expert is local."""
    training: bool
    """``nn.Module.training``: the block records its routing statistics only in training mode."""


_EXPERT_TYPES: list[type[nn.Module]] = []
_M = TypeVar("_M", bound=type[nn.Module])


def register_expert_layer(cls: _M) -> _M:
    """Declare ``cls`` a mixture-of-experts block (it provides :class:`ExpertLayer`); returns ``cls``."""
    if cls not in _EXPERT_TYPES:
        _EXPERT_TYPES.append(cls)
    return cls


def expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """The mixture-of-experts blocks inside ``model`` (any wrapper or pipeline stage), in module order."""
    types = tuple(_EXPERT_TYPES)
    if not types:
        return []
    return [cast(ExpertLayer, m) for m in model.modules() if isinstance(m, types)]
