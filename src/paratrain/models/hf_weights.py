"""Hugging Face weights in: each rank reads the slices it holds from the safetensors files.

The model is built with its parameters on the meta device (:func:`paratrain.models.hf.build_hf_model`) and
the strategy splits and shards it first (tensor-parallel plan, pipeline stages, FSDP2 units). Then
:func:`materialize_and_load` allocates what this rank holds (``to_empty``: a ``zero3`` rank allocates
``1/N`` of each parameter, never the whole model) and fills it with Distributed Checkpoint's
``HuggingFaceStorageReader`` (https://pytorch.org/docs/stable/distributed.checkpoint.html): DCP plans, per
rank, which slice of which tensor it needs (a ``Shard(0)`` DTensor's rows, a ``tp`` column block, only the
stages of a pipeline rank) and the reader copies ``safe_open(file).get_slice(name)[rows, cols]`` into the
local tensor, converting the dtype (bf16 files into fp32 parameters). Each slice is read from a memory map,
so a rank's peak is its own shard plus the slice being copied. ``dcp.load`` is collective (the ranks
exchange their read plans once); without a process group it runs in this process alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError

__all__ = ["checkpoint_keys", "load_state_dict_from_hf", "materialize", "materialize_and_load"]


def _canonical(name: str) -> str:
    parts = name.split(".")
    if parts and parts[0] == "module":
        parts = parts[1:]
    wrappers = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
    return ".".join(p for p in parts if p not in wrappers)


def checkpoint_keys(d: Path) -> set[str]:
    """Tensor names stored in the safetensors files of ``d`` (from the index, or the file headers)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    keys: set[str] = set()
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            keys.update(h.keys())
    return keys


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) every meta parameter on ``device`` with the layout the strategy gave it;
    buffers that were built real (rotary tables) keep their values."""
    saved = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"}
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # tied parameters: one tensor under several names
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m, name))
    model.to_empty(device=device)
    for group in owners.values():  # to_empty gives each name its own tensor: tie them again
        (m0, n0), *rest = group
        for m, name in rest:
            m._parameters[name] = m0._parameters[n0]
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n in saved:
                b.copy_(saved[n])


def load_state_dict_from_hf(
    state_dict: dict[str, Any], d: Path, tied_keys: dict[str, str] | None = None
) -> None:
    """Fill ``state_dict`` (tensors or DTensors, in place) from the safetensors files of ``d``; collective
    when a process group is up. A key the files lack is refused, except a tied copy of a present tensor
    (``tied_keys``: ``{head name: embedding name}`` of a model that ties them)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    have = checkpoint_keys(d)
    tied_keys = tied_keys or {}
    storages: dict[int, str] = {}
    target: dict[str, Any] = {}
    missing = []
    for key, t in state_dict.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        ptr = local.untyped_storage().data_ptr() if local.numel() else -1
        if key in have:
            target[key] = t
            storages.setdefault(ptr, key)
        else:
            missing.append((key, ptr))
    # a tied head (lm_head.weight = embed_tokens.weight) is saved once: its storage was filled above, or, on
    # a pipeline rank that holds the head and not the embedding, it is read from the embedding's name
    aliases = {a: b for b, a in tied_keys.items()} | tied_keys
    for key, ptr in list(missing):
        alias = aliases.get(key)
        if (ptr == -1 or ptr not in storages) and alias in have and alias not in target:
            target[alias] = state_dict[key]
            storages.setdefault(ptr, alias)
            missing.remove((key, ptr))
    unresolved = [k for k, ptr in missing if ptr == -1 or ptr not in storages]
    if unresolved:
        raise ConfigError(
            f"hf:{d}: the weight files lack {len(unresolved)} tensor(s) of the model, e.g. "
            f"{', '.join(sorted(unresolved)[:4])}. The directory's weights do not belong to its config.json."
        )
    dcp.load(target, storage_reader=HuggingFaceStorageReader(str(d)))


def materialize_and_load(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's part of ``model`` and read it from the model's directory (module docstring)."""
    from paratrain.models.hf_arch import DIR_ATTR

    d = getattr(model, DIR_ATTR, None)
    materialize(model, device)
    if d is None:
        return
    sd = {_canonical(k): v for k, v in model.state_dict().items()}
    load_state_dict_from_hf(sd, Path(d), _tied_keys(model))
    object.__setattr__(model, DIR_ATTR, None)


def _tied_keys(model: nn.Module) -> dict[str, str]:
    """``{output embedding name: input embedding name}`` when the model ties them (``transformers``'
    ``_tied_weights_keys``), else ``{}``."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    keys = getattr(model, "_tied_weights_keys", None)
    return {str(k): str(v) for k, v in keys.items()} if isinstance(keys, dict) else {}
