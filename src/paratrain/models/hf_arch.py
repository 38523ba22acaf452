"""What paratrain knows of a Hugging Face model's architecture: which ones it can split, the class a model
was built from, and its list of decoder layers. Shared by the builder (:mod:`.hf`), the parallel plans
(:mod:`.hf_parallel`) and the weight loader (:mod:`.hf_weights`); imports no ``transformers``."""

from __future__ import annotations

from torch import nn

from paratrain.errors import ConfigError
from paratrain.spec.capabilities import HF_PP_ARCHITECTURES, HF_TP_ARCHITECTURES

__all__ = [
    "DIR_ATTR",
    "HF_CLASS_ATTR",
    "PP_ARCHITECTURES",
    "TP_ARCHITECTURES",
    "architecture",
    "decoder_layers",
]

DIR_ATTR = "_paratrain_hf_dir"
"""Instance attribute: the directory whose weights the (meta) model still has to load."""
HF_CLASS_ATTR = "_paratrain_hf_class"
"""Instance attribute: the original ``transformers`` class (for ``generate`` and export)."""
TP_ARCHITECTURES = HF_TP_ARCHITECTURES
"""Architectures with a tensor-parallel plan (the names live in :mod:`paratrain.spec.capabilities`, which
``paratrain train`` reads before torch is imported)."""
PP_ARCHITECTURES = HF_PP_ARCHITECTURES
"""Architectures that can be cut into pipeline stages."""


def architecture(model: nn.Module) -> str:
    cls = getattr(model, HF_CLASS_ATTR, type(model))
    return str(cls.__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``ModuleList`` of the model's repeated decoder blocks: of those whose entries are instances of the
    classes in ``_no_split_modules``, the one holding the most parameters (a vision-language model lists its
    vision encoder's layers there too); else the longest ``ModuleList`` of modules."""
    wanted = set(getattr(model, "_no_split_modules", None) or ())
    best: nn.ModuleList | None = None
    blocks: list[nn.ModuleList] = []
    for _, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            continue
        present = [b for b in m if b is not None]
        if wanted and present and all(type(b).__name__ in wanted for b in present):
            blocks.append(m)
        if best is None or len(m) > len(best):
            best = m
    if blocks:
        return max(blocks, key=lambda m: sum(p.numel() for p in m.parameters()))
    if best is None:
        raise ConfigError(f"{architecture(model)}: found no list of decoder layers to shard block by block.")
    return best
