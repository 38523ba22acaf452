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

Checkpoints in a layout other than the model's own are read through ``transformers``' conversion mapping for
the model (``get_model_conversion_mapping``, what ``from_pretrained`` applies): renamed tensors are read under
their stored names, and tensors that ``transformers`` builds from several stored ones (a mixture-of-experts
layer's ``experts.gate_up_proj``, stacked from every expert's ``w1``/``w3`` or ``gate_proj``/``up_proj`` in
Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints) are assembled one at a time with the mapping's own operations,
and each rank keeps its shard of the result.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError

__all__ = [
    "checkpoint_keys",
    "load_state_dict_from_hf",
    "materialize",
    "materialize_and_load",
    "weight_transforms",
]


def _canonical(name: str) -> str:
    parts = name.split(".")
    if parts and parts[0] == "module":
        parts = parts[1:]
    wrappers = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}
    return ".".join(p for p in parts if p not in wrappers)


def checkpoint_keys(d: Path) -> set[str]:
    """Tensor names stored in the safetensors files of ``d`` (from the index, or the file headers)."""
    return set(_weight_map(d))


def _weight_map(d: Path) -> dict[str, str]:
    """``{stored tensor name: file name}`` of ``d`` (from the index, or the file headers)."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    where: dict[str, str] = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            where.update(dict.fromkeys(h.keys(), f.name))
    return where


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


def weight_transforms(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """``transformers``' conversion mapping of ``model`` (the first ``PreTrainedModel`` in it) as (renamings,
    converters); empty for a model whose checkpoints are stored as its parameters are named."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    from paratrain.models.hf_arch import HF_CLASS_ATTR

    root = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if root is None:
        return [], []
    # transformers looks the mapping up by class name first (GPT-NeoX's embed_out -> lm_head is its
    # GPTNeoXForCausalLM's) and skips classes defined outside it: ask as the class transformers built
    built, original = type(root), getattr(root, HF_CLASS_ATTR, type(root))
    root.__class__ = original
    try:
        transforms = get_model_conversion_mapping(root)
    finally:
        root.__class__ = built
    return (
        [t for t in transforms if isinstance(t, WeightRenaming)],
        [t for t in transforms if isinstance(t, WeightConverter)],
    )


def _natural(key: str) -> list[Any]:
    """Sort key that orders ``experts.10`` after ``experts.9``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def _map_keys(
    have: set[str], transforms: tuple[list[Any], list[Any]]
) -> tuple[dict[str, str], dict[str, tuple[Any, dict[str, list[str]]]]]:
    """The model's name of every stored tensor: ``{model key: stored key}`` for a tensor stored whole (renamed
    or not), and ``{model key: (converter, {source pattern: stored keys in order})}`` for one assembled from
    several."""
    renamings, converters = transforms
    if not renamings and not converters:
        return {k: k for k in have}, {}
    from transformers.core_model_loading import rename_source_key

    whole: dict[str, str] = {}
    assembled: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(have, key=_natural):
        name, pattern = rename_source_key(key, renamings, converters)
        if pattern is None:
            whole.setdefault(name, key)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        assembled.setdefault(name, (converter, {}))[1].setdefault(pattern, []).append(key)
    return whole, assembled


def _assemble(
    d: Path, files: dict[str, str], converter: Any, sources: dict[str, list[str]], like: torch.Tensor
) -> torch.Tensor:
    """The whole tensor ``converter`` builds from the stored ``sources`` (read from ``d``, ``files``: stored key
    -> file name), as ``like``'s dtype."""
    from safetensors import safe_open

    handles: dict[str, Any] = {}

    def read(key: str) -> torch.Tensor:
        name = files[key]
        if name not in handles:
            handles[name] = safe_open(str(d / name), framework="pt")
        return handles[name].get_tensor(key).to(like.dtype)

    tensors: dict[str, Any] = {p: [read(k) for k in keys] for p, keys in sources.items()}
    for op in converter.operations:
        tensors = op.convert(tensors, source_patterns=list(converter.source_patterns),
                             target_patterns=list(converter.target_patterns))  # fmt: skip
    if len(tensors) != 1:
        raise ConfigError(
            f"{d}: transformers' conversion {converter!r} gave {len(tensors)} tensors, expected 1."
        )
    (full,) = tensors.values()
    return full


def _copy_into(t: Any, full: torch.Tensor, key: str, d: Path) -> None:
    """Copy this rank's part of ``full`` into ``t`` (a tensor, or a DTensor's local shard)."""
    if tuple(full.shape) != tuple(t.shape):
        raise ConfigError(
            f"hf:{d}: {key} is {tuple(t.shape)} in the model and {tuple(full.shape)} as assembled from the weight "
            "files. The directory's weights do not belong to its config.json."
        )
    with torch.no_grad():
        if hasattr(t, "to_local"):
            from torch.distributed.tensor import distribute_tensor

            mine = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local()
            t.to_local().copy_(mine)
        else:
            t.copy_(full)


def load_state_dict_from_hf(
    state_dict: dict[str, Any],
    d: Path,
    tied_keys: dict[str, str] | None = None,
    transforms: tuple[list[Any], list[Any]] = ([], []),
) -> None:
    """Fill ``state_dict`` (tensors or DTensors, in place) from the safetensors files of ``d``; collective
    when a process group is up. A key the files lack is refused, except a tied copy of a present tensor
    (``tied_keys``: ``{head name: embedding name}`` of a model that ties them). ``transforms``: the model's
    conversion mapping (:func:`weight_transforms`), for checkpoints stored in another layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    files = _weight_map(d)
    stored, assembled = _map_keys(set(files), transforms)
    have = set(stored)
    tied_keys = tied_keys or {}
    storages: dict[int, str] = {}
    target: dict[str, Any] = {}
    built: list[str] = []
    missing = []
    for key, t in state_dict.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        ptr = local.untyped_storage().data_ptr() if local.numel() else -1
        if key in have:
            target[stored[key]] = t  # read under its stored name
            storages.setdefault(ptr, key)
        elif key in assembled:
            built.append(key)
            storages.setdefault(ptr, key)
        else:
            missing.append((key, ptr))
    # a tied head (lm_head.weight = embed_tokens.weight) is saved once: its storage was filled above, or, on
    # a pipeline rank that holds the head and not the embedding, it is read from the embedding's name
    aliases = {a: b for b, a in tied_keys.items()} | tied_keys
    for key, ptr in list(missing):
        alias = aliases.get(key)
        if (ptr == -1 or ptr not in storages) and alias in have and stored[alias] not in target:
            target[stored[alias]] = state_dict[key]
            storages.setdefault(ptr, alias)
            missing.remove((key, ptr))
    unresolved = [k for k, ptr in missing if ptr == -1 or ptr not in storages]
    if unresolved:
        raise ConfigError(
            f"hf:{d}: the weight files lack {len(unresolved)} tensor(s) of the model, e.g. "
            f"{', '.join(sorted(unresolved)[:4])}. The directory's weights do not belong to its config.json."
        )
    dcp.load(target, storage_reader=HuggingFaceStorageReader(str(d)))
    for key in built:  # one assembled tensor at a time: its whole, then this rank's part of it
        converter, sources = assembled[key]
        t = state_dict[key]
        like = t.to_local() if hasattr(t, "to_local") else t
        _copy_into(t, _assemble(d, files, converter, sources, like), key, d)


def materialize_and_load(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's part of ``model`` and read it from the model's directory (module docstring)."""
    from paratrain.models.hf_arch import DIR_ATTR

    d = getattr(model, DIR_ATTR, None)
    materialize(model, device)
    if d is None:
        return
    sd = {_canonical(k): v for k, v in model.state_dict().items()}
    load_state_dict_from_hf(sd, Path(d), _tied_keys(model), weight_transforms(model))
    object.__setattr__(model, DIR_ATTR, None)


def _tied_keys(model: nn.Module) -> dict[str, str]:
    """``{output embedding name: input embedding name}`` when the model ties them (``transformers``'
    ``_tied_weights_keys``), else ``{}``."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    keys = getattr(model, "_tied_weights_keys", None)
    return {str(k): str(v) for k, v in keys.items()} if isinstance(keys, dict) else {}
