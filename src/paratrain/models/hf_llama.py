"""paratrain's Llama <-> Hugging Face ``LlamaForCausalLM``: one state-dict adapter, both directions.

Names: ``tok_embeddings`` <-> ``model.embed_tokens``, ``layers.i.attention.wq/wk/wv/wo`` <->
``model.layers.i.self_attn.q_proj/k_proj/v_proj/o_proj``, ``feed_forward.w1/w3/w2`` <-> ``mlp.gate_proj/
up_proj/down_proj``, ``attention_norm``/``ffn_norm`` <-> ``input_layernorm``/``post_attention_layernorm``,
``norm`` <-> ``model.norm``, ``output`` <-> ``lm_head``.

Rotary embeddings: paratrain rotates channel pairs ``(2j, 2j+1)`` of each head (Meta's layout), Hugging Face
rotates ``(j, j + head_dim/2)`` (``rotate_half``). The same attention results when the output rows of
``wq`` and ``wk`` are permuted within each head: Meta -> HF takes, per head, the even rows then the odd rows
(``view(heads, head_dim/2, 2, dim).transpose(1, 2)``), as ``transformers``' own
``convert_llama_weights_to_hf.py`` does; HF -> Meta is the inverse.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.errors import ConfigError

__all__ = ["from_hf_name", "hf_config", "load_hf_into_llama", "to_hf", "to_hf_name"]

_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def to_hf_name(name: str) -> str:
    """paratrain parameter name -> Hugging Face name."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.weight"
    raise ValueError(f"no Hugging Face name for paratrain Llama parameter {name!r}")


def from_hf_name(name: str) -> str:
    """Hugging Face ``LlamaForCausalLM`` name -> paratrain parameter name."""
    for ours, theirs in _TOP.items():
        if name == f"{theirs}.weight":
            return f"{ours}.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    inverse = {v: k for k, v in _LAYER.items()}
    if m and m.group(2) in inverse:
        return f"layers.{m.group(1)}.{inverse[m.group(2)]}.weight"
    raise ValueError(f"no paratrain Llama parameter for {name!r}")


def _permute(w: torch.Tensor, heads: int, to_hf: bool) -> torch.Tensor:
    rows, cols = w.shape
    half = rows // heads // 2
    if to_hf:
        return w.reshape(heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)
    return w.reshape(heads, 2, half, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(name: str, t: torch.Tensor, cfg: Any) -> tuple[str, torch.Tensor]:
    """One paratrain tensor as its Hugging Face name and layout."""
    if name.endswith("attention.wq.weight"):
        t = _permute(t, cfg.n_heads, to_hf=True)
    elif name.endswith("attention.wk.weight"):
        t = _permute(t, cfg.n_kv_heads, to_hf=True)
    return to_hf_name(name), t.contiguous()


def hf_config(cfg: Any) -> dict[str, Any]:
    """``config.json`` of the ``LlamaForCausalLM`` with paratrain's Llama shape ``cfg``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.dim // cfg.n_heads,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": "float32",
    }


def load_hf_into_llama(model: nn.Module, d: Path) -> None:
    """Fill paratrain's ``model`` (full, real tensors) from the ``LlamaForCausalLM`` directory ``d``: names
    mapped, ``wq``/``wk`` rows permuted back; a shape, layer count or architecture mismatch is refused."""
    from safetensors import safe_open

    from paratrain.models.hf import weight_files

    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"--init-from hf:{d}: {d} has no config.json.")
    hf = json.loads(cfg_path.read_text())
    if hf.get("model_type") != "llama":
        raise ConfigError(
            f"--init-from hf:{d}: it is a {hf.get('model_type')!r} model; paratrain's Llama loads LlamaForCausalLM "
            "checkpoints only. Train it as --model hf:DIR instead."
        )
    files = weight_files(d)
    if not files:
        raise ConfigError(f"--init-from hf:{d}: the directory has no safetensors weights.")
    ours = dict(model.named_parameters())
    cfg: Any = model.config
    seen: set[str] = set()
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    try:
                        name = from_hf_name(key)
                    except ValueError:
                        continue  # e.g. rotary inv_freq of old checkpoints
                    if name not in ours:
                        raise ConfigError(
                            f"--init-from hf:{d}: {key} has no place in --model's Llama ({name} is missing: "
                            "more layers than model.n_layers?). Match the shape with --set model.*."
                        )
                    t = h.get_tensor(key)
                    if name.endswith("attention.wq.weight"):
                        t = _permute(t, cfg.n_heads, to_hf=False)
                    elif name.endswith("attention.wk.weight"):
                        t = _permute(t, cfg.n_kv_heads, to_hf=False)
                    if t.shape != ours[name].shape:
                        raise ConfigError(
                            f"--init-from hf:{d}: {key} has shape {tuple(t.shape)}, the model's {name} "
                            f"{tuple(ours[name].shape)}. Match the shape with --set model.* (dim, n_heads, ...)."
                        )
                    ours[name].copy_(t)
                    seen.add(name)
    missing = sorted(set(ours) - seen - ({"output.weight"} if cfg.tie_embeddings else set()))
    if missing:
        raise ConfigError(f"--init-from hf:{d}: the checkpoint lacks {', '.join(missing[:4])}.")
