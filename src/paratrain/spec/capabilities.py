"""Which model-parallel axes (tp, pp, ep) each built-in model family supports, known without torch.

``paratrain train`` refuses a model-parallel strategy on a model that cannot take it before anything imports
torch (:func:`check_model_axes`), in the words the launch-time checks of :mod:`paratrain.parallel` use on the
built model. What is not known here (a ``pkg.module:factory`` model, an entry-point plugin, an ``hf:``
directory whose class is unclear) passes on to those checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.spec.llama import PRESETS
from paratrain.spec.topology import Topology

__all__ = ["HF_PP_ARCHITECTURES", "HF_TP_ARCHITECTURES", "Capabilities", "capabilities", "check_model_axes"]

HF_TP_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel"
)  # fmt: skip
"""Hugging Face architectures with a tensor-parallel plan (the config's ``base_model_tp_plan``, GPT-2's own,
plus the embedding and the head)."""
HF_PP_ARCHITECTURES: tuple[str, ...] = HF_TP_ARCHITECTURES
"""Hugging Face architectures that can be cut into pipeline stages."""


@dataclass(frozen=True)
class Capabilities:
    """What one model supports; ``cls`` is the class name the launch-time messages name."""

    cls: str
    tp: bool = False
    pp: bool = False
    ep: bool = False
    hf: bool = False


_TENSOR_MODELS: dict[str, str] = {
    "mlp": "MLP", "cnn": "CNN", "resnet": "ResNet", "resnet18": "ResNet", "resnet34": "ResNet"
}  # fmt: skip
_HF_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def capabilities(model: str, n_experts: int | None = None) -> Capabilities | None:
    """The capabilities of ``--model model`` (``n_experts``: the ``model.n_experts`` override), or ``None``
    when they are only known once the model is built."""
    if model in _TENSOR_MODELS:
        return Capabilities(_TENSOR_MODELS[model])
    if model in PRESETS:
        experts = PRESETS[model].n_experts if n_experts is None else n_experts
        return Capabilities("Llama", tp=True, pp=True, ep=bool(experts))
    if model.startswith("hf:"):
        arch = _hf_architecture(Path(model[3:]))
        if arch is None:
            return None
        return Capabilities(arch, tp=arch in HF_TP_ARCHITECTURES, pp=arch in HF_PP_ARCHITECTURES, hf=True)
    return None


def _hf_architecture(d: Path) -> str | None:
    """The causal-LM class named by ``DIR/config.json`` when it names exactly one (else ``None``: the builder
    reads and checks the directory)."""
    try:
        cfg: Any = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if cfg.get("is_encoder_decoder") or not isinstance(archs, list) or len(archs) != 1:
        return None
    arch = archs[0]
    return arch if isinstance(arch, str) and arch.endswith(_HF_CAUSAL_SUFFIXES) else None


def no_tp_plan(name: str) -> str:
    """The refusal of tensor parallelism on a model without a TP plan (``name``: its class, as users see it)."""
    return (
        f"tensor parallelism needs a model with a TP plan; {name} has none (the Llama models have one: "
        "--model llama-debug, llama-small). From Python, pass setup(..., tp_plan=...)."
    )


def no_stage_split(name: str) -> str:
    """The refusal of pipeline parallelism on a model that cannot be cut into stages."""
    return (
        f"pipeline parallelism needs a model that can be split into stages; {name} cannot (the Llama models "
        "can: --model llama-debug, llama-small)."
    )


def no_moe_layer(name: str, ep: int) -> str:
    """The refusal of expert parallelism on a model without MoE layers."""
    return (
        f"expert parallelism (--ep {ep}) splits the experts of a mixture-of-experts model, and {name} has no "
        "MoE layer. Use an MoE model (--model llama-moe-debug, llama-moe-small, or --set model.n_experts=8), "
        "or a strategy without ep (ddp, zero3)."
    )


def hf_no_tp(arch: str, tp: int, can_pipeline: bool) -> str:
    """The refusal of tensor parallelism on a Hugging Face architecture without a plan here."""
    return (
        f"tensor parallelism (strategy tp, fsdp+tp or fsdp+tp+pp, --tp {tp}) is not supported for {arch}: "
        f"paratrain has tensor-parallel plans for {', '.join(HF_TP_ARCHITECTURES)}. Use a data-parallel "
        "strategy (ddp, zero1/2/3, hsdp)" + (", pp or fsdp+pp" if can_pipeline else "") + " for this model."
    )


def hf_no_pp(arch: str) -> str:
    """The refusal of pipeline parallelism on a Hugging Face architecture without a stage split here."""
    return (
        f"pipeline parallelism (strategy pp, fsdp+pp or fsdp+tp+pp) is not supported for {arch}: paratrain "
        f"splits {', '.join(HF_PP_ARCHITECTURES)} into stages. Use a data-parallel strategy (ddp, zero1/2/3, "
        "hsdp) for this model."
    )


def hf_no_ep(arch: str, ep: int) -> str:
    """The refusal of expert parallelism on a Hugging Face model: ep splits paratrain's own MoE layers."""
    return (
        f"expert parallelism (--ep {ep}) splits the experts of paratrain's own MoE layers (its MoE Llama: --model "
        f"llama-moe-small, mixtral-8x7b, qwen3-30b-a3b, ...); the layers of {arch} are transformers' modules, "
        "which it does not split. Use a data-parallel strategy (ddp, zero1/2/3, hsdp) for this model."
    )


def check_model_axes(model: str, n_experts: int | None, topology: Topology) -> None:
    """Refuse a tensor, pipeline or expert degree above 1 on a built-in model that cannot split that way, in
    the order and words of the launch-time checks (tensor, pipeline, then experts)."""
    caps = capabilities(model, n_experts)
    if caps is None:
        return
    if topology.tp > 1 and not caps.tp:
        raise ConfigError(hf_no_tp(caps.cls, topology.tp, caps.pp) if caps.hf else no_tp_plan(caps.cls))
    if topology.pp > 1 and not caps.pp:
        raise ConfigError(hf_no_pp(caps.cls) if caps.hf else no_stage_split(caps.cls))
    if topology.ep > 1 and caps.hf:
        raise ConfigError(hf_no_ep(caps.cls, topology.ep))
    if topology.ep > 1 and not caps.ep:
        raise ConfigError(no_moe_layer(caps.cls, topology.ep))
