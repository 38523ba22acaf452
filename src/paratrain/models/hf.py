"""Hugging Face causal language models from a local directory: ``--model hf:DIR``.

``DIR`` is a directory in the Hugging Face layout: ``config.json``, the weights as ``model.safetensors`` or
as sharded ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, and optionally
``tokenizer.json`` / ``tokenizer_config.json`` / ``generation_config.json``. Nothing is ever downloaded. A
``DIR`` with a config and no weights means random initialisation (from ``train.seed``, the same on every
rank).

**The model code is ``transformers``' own**: ``AutoModelForCausalLM.from_config`` on the meta device, then
the (small, computed) buffers rebuilt on the CPU, so any decoder-only causal LM builds without allocating or
initialising its weights. The instance's class is swapped for a subclass whose ``forward(input_ids)`` returns
the logits tensor (the trainer's contract) and the parameter names stay Hugging Face's
(``model.layers.3.self_attn.q_proj.weight``), in every layout and in every checkpoint.

**Weights are loaded where they are held** (:mod:`paratrain.models.hf_weights`): the strategy splits and
shards the meta model first, then each rank allocates what it holds and reads exactly those slices from
the safetensors files with DCP's ``HuggingFaceStorageReader`` (``safe_open(...).get_slice``). Under
``ddp`` that is the whole model per rank; under ``zero3``/``hsdp``/``fsdp+*``/``tp``/``pp`` a rank's slice.

**The spec** (:class:`~paratrain.models.spec.ModelSpec`) attached to each instance: the FSDP units are the
decoder layers, found from the model itself (the ``ModuleList`` of the base model whose entries are the
classes in ``_no_split_modules``); FLOPs per token from the config (PaLM's ``6N + 12·L·H·Q·T``); for Llama,
Qwen2, Qwen3, Mistral and GPT-2, the tensor-parallel plan and the pipeline split of
:mod:`paratrain.models.hf_parallel`. ``transformers`` is imported only here and only when an ``hf:`` model
is built.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.models.hf_arch import (
    DIR_ATTR,
    HF_CLASS_ATTR,
    PP_ARCHITECTURES,
    TP_ARCHITECTURES,
    architecture,
    decoder_layers,
)
from paratrain.models.spec import ModelSpec, attach_spec

__all__ = [
    "HF_PREFIX",
    "build_hf_model",
    "check_hf_dir",
    "decoder_layers",
    "hf_dir_of",
    "hf_flops_per_token",
    "weight_files",
]

HF_PREFIX = "hf:"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def hf_dir_of(name: str) -> Path:
    """The directory of ``--model hf:DIR``."""
    return Path(name[len(HF_PREFIX) :]).expanduser()


def read_config_json(d: Path) -> dict[str, Any]:
    """``DIR/config.json`` as a dict, refused with one line when missing or not JSON."""
    path = d / "config.json"
    if not d.is_dir():
        raise ConfigError(
            f"--model hf:{d}: {d} is not a directory. Give a local Hugging Face model directory (config.json "
            "and model*.safetensors); nothing is downloaded."
        )
    if not path.is_file():
        raise ConfigError(
            f"--model hf:{d}: {d} has no config.json, so it is not a Hugging Face model directory. Give the "
            "directory that save_pretrained() wrote (config.json, model*.safetensors)."
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model hf:{d}: config.json is not readable JSON ({e}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--model hf:{d}: config.json holds {type(data).__name__}, not an object.")
    return data


def weight_files(d: Path) -> list[Path]:
    """The safetensors files of ``d`` (``[]``: no weights, random initialisation). An index naming a file
    that is not there, or ``.bin`` weights only, is refused."""
    index = d / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"--model hf:{d}: {INDEX} has no readable weight_map ({e}).") from None
        missing = [n for n in names if not (d / n).is_file()]
        if missing:
            raise ConfigError(
                f"--model hf:{d}: {INDEX} names {len(missing)} weight file(s) that are not in the directory: "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}. Copy the missing shards, or "
                "save the model again with save_pretrained()."
            )
        return [d / n for n in names]
    if (d / SINGLE).is_file():
        return [d / SINGLE]
    if any(d.glob("*.bin")) or any(d.glob("*.pt")):
        raise ConfigError(
            f"--model hf:{d}: the weights are pickled (.bin/.pt), which paratrain does not unpickle. Convert "
            "them once with save_pretrained(DIR, safe_serialization=True)."
        )
    return []


def check_hf_dir(d: Path) -> dict[str, Any]:
    """Launch-time checks of an ``hf:`` directory (config, weight files); returns the config dict."""
    cfg = read_config_json(d)
    archs = cfg.get("architectures") or []
    if cfg.get("is_encoder_decoder"):
        raise ConfigError(
            f"--model hf:{d}: {archs[0] if archs else cfg.get('model_type')} is an encoder-decoder model; "
            "paratrain trains decoder-only causal language models (AutoModelForCausalLM)."
        )
    weight_files(d)
    return cfg


# ---- the module -------------------------------------------------------------------------------------------
def _real_buffers(model: nn.Module) -> None:
    """A model built on the meta device gets its computed buffers (rotary ``inv_freq`` tables, Gemma's
    embedding scale) back; the weights stay on the meta device. A module with a config (the rotary
    embeddings) is built once more, alone, on the CPU and its buffers are taken (small: a few numbers per head
    dimension); any other gets CPU buffers filled by the model's own ``_init_weights`` (how ``transformers``
    sets the non-persistent buffers of a model it built on the meta device)."""
    for name, m in model.named_modules():
        if not any(b.device.type == "meta" for b in m.buffers(recurse=False)):
            continue
        config = getattr(m, "config", None)
        if config is None:
            _init_buffers(model, name, m)
            continue
        with torch.device("cpu"):
            fresh = type(m)(config)
        for key, buf in fresh.named_buffers(recurse=False):
            m._buffers[key] = buf


def _init_buffers(model: nn.Module, name: str, m: nn.Module) -> None:
    """``m``'s meta buffers as CPU tensors set by ``model._init_weights(m)`` (floating ones start as NaN, so a
    buffer it does not set is caught, not trained with)."""
    meta = [k for k, b in m._buffers.items() if b is not None and b.device.type == "meta"]
    for k in meta:
        b = m._buffers[k]
        assert b is not None
        m._buffers[k] = torch.full_like(b, float("nan") if b.is_floating_point() else 0, device="cpu")
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        if init is not None:
            init(m)
    unset = [
        k for k in meta if (b := m._buffers[k]) is not None and b.is_floating_point() and b.isnan().any()
    ]
    if init is None or unset:
        raise ConfigError(
            f"{type(model).__name__}: the module {name} ({type(m).__name__}) has computed buffers "
            f"({', '.join(unset or meta)}) that neither its config nor the model's _init_weights computes on a "
            "real device; paratrain cannot build this model on the meta device."
        )


_LOGITS_CLASSES: dict[type, type] = {}


def _logits_class(cls: type) -> type:
    """A subclass of the ``transformers`` class whose ``forward(input_ids)`` returns the logits tensor (no
    cache), which is what the trainer's loss, evaluation and the pipeline schedules take."""
    if cls not in _LOGITS_CLASSES:

        def forward(self: Any, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return cls.forward(self, input_ids=input_ids, use_cache=False, **kwargs).logits  # type: ignore[attr-defined]

        _LOGITS_CLASSES[cls] = type(f"Paratrain{cls.__name__}", (cls,), {"forward": forward})
    return _LOGITS_CLASSES[cls]


def cached_forward(model: nn.Module) -> Callable[..., Any] | None:
    """The ``transformers`` class's own ``forward`` of an hf model (the one that takes the cache and returns
    it), for incremental decoding; ``None`` for any other model."""
    base: Any = next((b for b in type(model).__mro__[1:] if _LOGITS_CLASSES.get(b) is type(model)), None)
    return None if base is None else base.forward


def load_config(d: Path) -> Any:
    """The ``transformers`` config of ``d`` (local files only), prepared for training: no KV cache, SDPA."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(d), local_files_only=True)
    config.use_cache = False
    return config


def attention_implementation(config: Any) -> str:
    """``"sdpa"`` (PyTorch's fused attention), or ``"eager"`` for an architecture ``transformers`` builds
    without it (Gemma 2's soft-capped attention scores, among others)."""
    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except (KeyError, AttributeError):
        return "sdpa"  # transformers' own error names the problem when it builds the model
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def build_hf_model(d: Path, vocab_needed: int | None = None) -> nn.Module:
    """The model of ``d``: parameters on the meta device when ``d`` has weights (loaded after the strategy
    split it), else randomly initialised on the CPU from the current seed. Carries its spec."""
    check_hf_dir(d)
    from transformers import AutoModelForCausalLM

    config = load_config(d)
    if vocab_needed is not None and vocab_needed > config.vocab_size:
        raise ConfigError(
            f"--model hf:{d} has a vocabulary of {config.vocab_size} tokens, but the data's tokenizer has "
            f"{vocab_needed}. Use the model's own tokenizer (leave data.tokenizer unset)."
        )
    has_weights = bool(weight_files(d))
    meta_context = _default_device_is_meta()  # the launch-time checks build every model on the meta device
    ctx = torch.device("meta") if has_weights and not meta_context else contextlib.nullcontext()
    with ctx:
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config),
                                                     dtype=torch.float32)  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"--model hf:{d}: transformers cannot build it as a causal LM ({e}).") from None
    if has_weights and not meta_context:
        _real_buffers(model)
    original = type(model)
    model.__class__ = _logits_class(original)
    object.__setattr__(model, HF_CLASS_ATTR, original)
    object.__setattr__(model, "_paratrain_matmul_params", _matmul_params(model))
    if has_weights:
        object.__setattr__(model, DIR_ATTR, str(d))
    return attach_spec(model, hf_spec(model))


def _default_device_is_meta() -> bool:
    return torch.empty(()).device.type == "meta"


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    return [b for b in decoder_layers(model) if b is not None]


def hf_flops_per_token(config: Any, num_params: int, embedding_params: int, seq_len: int) -> float:
    """PaLM's training FLOPs per token, ``6·N + 12·L·H·Q·T``, with ``N`` the parameters except the input
    embeddings (see :func:`paratrain.models.llama.flops_per_token`)."""
    layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0))
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
    head_dim = int(getattr(config, "head_dim", None) or (hidden // heads if heads else 0))
    return 6.0 * (num_params - embedding_params) + 12.0 * layers * heads * head_dim * seq_len


def _matmul_params(model: nn.Module) -> tuple[int, int]:
    """``(parameters + a tied head, input-embedding parameters)`` of the whole model: every weight that takes
    part in a matmul is the first minus the second (the token and, for GPT-2, the learned-position tables are
    looked up, not multiplied; a head tied to the embedding still does its matmul, so it counts)."""
    m: Any = model
    n = sum(p.numel() for p in model.parameters())
    lookup = 0
    for e in _embeddings(model):
        weight: Any = e.weight
        lookup += int(weight.numel())
    head = m.get_output_embeddings()
    tied = head is not None and head.weight is m.get_input_embeddings().weight
    return n + (head.weight.numel() if tied else 0), lookup


def _flops(model: nn.Module, seq_len: int) -> float:
    # counted on the whole model at build time: a pipeline rank keeps only its stages
    n, lookup = getattr(model, "_paratrain_matmul_params", None) or _matmul_params(model)
    return hf_flops_per_token(model.config, n, lookup, seq_len)


def _embeddings(model: nn.Module) -> list[nn.Module]:
    out = [model.get_input_embeddings()]  # type: ignore[operator]
    pos = getattr(getattr(model, "transformer", None), "wpe", None)  # GPT-2's learned positions
    return [e for e in (*out, pos) if isinstance(e, nn.Embedding)]


def _load(model: nn.Module, device: torch.device) -> None:
    from paratrain.models.hf_weights import materialize_and_load

    materialize_and_load(model, device)


def hf_spec(model: nn.Module) -> ModelSpec:
    """The spec of one ``transformers`` model instance (plans by architecture)."""
    arch = architecture(model)
    family = f"hf:{arch}"
    from paratrain.models import hf_parallel

    tp_fields: dict[str, Any] = {"check_tp": hf_parallel.refuse_tp}
    if arch in TP_ARCHITECTURES:
        tp_fields = {"tp_plan": hf_parallel.tp_plan, "check_tp": hf_parallel.check_tp}
    pp_fields: dict[str, Any] = {"check_pipeline": hf_parallel.refuse_pp}
    if arch in PP_ARCHITECTURES:
        pp_fields = {
            "pipeline_split": hf_parallel.pipeline_split,
            "check_pipeline": hf_parallel.check_pipeline,
            "stage_blocks": hf_parallel.stage_blocks,
        }
    return ModelSpec(
        family=family,
        fsdp_units=_fsdp_units,
        flops_per_token=_flops,
        materialize=_load,
        **tp_fields,
        **pp_fields,
    )
