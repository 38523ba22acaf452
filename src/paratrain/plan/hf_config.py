"""The shape of a Hugging Face model from its ``config.json`` alone: ``paratrain plan --model hf:DIR``.

No weights, no ``transformers``, no torch: the JSON is read here and mapped onto
:class:`~paratrain.plan.model.TransformerShape`, so a Llama 3 405B or any other published dense decoder can
be planned on a laptop. Llama, Qwen2/Qwen3 and Mistral map to ``arch="llama"`` (RMSNorm, SwiGLU MLP of
``intermediate_size``, grouped-query attention, rotary positions); GPT-2 to ``arch="gpt"`` (LayerNorm, GeLU
MLP of ``n_inner`` or 4·``n_embd``, biases, learned positions, head tied unless ``tie_word_embeddings`` is
false). The parameter count is ``transformers``' exactly: an explicit ``head_dim`` (Qwen3, Mistral Nemo) sets
the attention width, and Qwen2's q/k/v biases, Llama's ``attention_bias``/``mlp_bias`` and Qwen3's per-head
q/k norms are counted per layer.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan.model import ModelSpec, ParamGroup, TransformerShape, spec_from_shape

__all__ = ["LLAMA_LIKE", "MOE_TYPES", "hf_config_path", "shape_from_hf_config", "spec_from_hf_config"]

LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")
"""``model_type`` values planned as ``arch="llama"``."""
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts ``model_type`` values: a Llama-like attention, and routed experts (SwiGLU) in place of the
MLP of every layer (Mixtral) or of every ``decoder_sparse_step``-th layer outside ``mlp_only_layers`` (Qwen2-MoE,
with a gated shared expert, and Qwen3-MoE). paratrain trains them under its data-parallel strategies."""


def hf_config_path(name: str) -> Path | None:
    """The ``config.json`` named by ``--model``: ``hf:DIR``, a directory holding one, or the file itself;
    ``None`` when ``name`` is not such a reference (a registry name)."""
    if name.startswith("hf:"):
        p = Path(name[3:]).expanduser()
    elif name.endswith(".json"):
        p = Path(name).expanduser()
    else:
        return None
    path = p / "config.json" if p.is_dir() else p
    if not path.is_file():
        raise ConfigError(
            f"--model {name}: {path} does not exist. Give hf:DIR with a Hugging Face config.json in DIR, or the "
            "path of a config.json."
        )
    return path


def _get(cfg: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return None


def _read(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({e}).") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: not a Hugging Face config (a JSON object).")
    return cfg


def shape_from_hf_config(path: Path) -> TransformerShape:
    """The :class:`TransformerShape` of the ``config.json`` at ``path`` (refused, naming it, when the model
    type is not a decoder the planner models). For a mixture of experts, the shape of its dense skeleton:
    ``ffn_hidden`` is ``intermediate_size`` (:func:`spec_from_hf_config` adds the experts)."""
    cfg = _read(path)
    kind = str(cfg.get("model_type", ""))
    if kind == "gpt2":
        dim = int(cfg["n_embd"])
        return TransformerShape(
            dim=dim, n_layers=int(cfg["n_layer"]), n_heads=int(cfg["n_head"]), n_kv_heads=int(cfg["n_head"]),
            ffn_hidden=int(cfg.get("n_inner") or 4 * dim), vocab_size=int(cfg["vocab_size"]),
            max_seq_len=int(cfg.get("n_positions") or 1024), arch="gpt",
            tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        )  # fmt: skip
    if kind not in LLAMA_LIKE + MOE_TYPES:
        raise ConfigError(
            f"{path}: model_type {kind!r} is not one the planner models from a config (dense "
            f"{', '.join(LLAMA_LIKE)} and gpt2; the mixtures of experts {', '.join(MOE_TYPES)}). Plan it with "
            "--params N (states only)."
        )
    try:
        heads, dim = int(cfg["num_attention_heads"]), int(cfg["hidden_size"])
        kv, ffn = int(_get(cfg, "num_key_value_heads") or heads), int(cfg["intermediate_size"])
        head_dim = int(_get(cfg, "head_dim") or dim // heads)
        return TransformerShape(
            dim=dim, n_layers=int(cfg["num_hidden_layers"]), n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn,
            vocab_size=int(cfg["vocab_size"]), max_seq_len=int(_get(cfg, "max_position_embeddings") or 4096),
            arch="llama", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attn_head_dim=head_dim if head_dim * heads != dim else 0,
            layer_extra=_layer_extra(kind, cfg, dim, heads * head_dim, kv * head_dim, head_dim, ffn),
        )  # fmt: skip
    except KeyError as e:
        raise ConfigError(f"{path}: the config has no {e.args[0]!r}, which the shape needs.") from None


def _layer_extra(
    kind: str, cfg: dict[str, Any], h: int, q: int, kv: int, head_dim: int, ffn: int
) -> ParamGroup:
    """The parameters of one layer beyond the bias-free Llama formula, as ``transformers`` builds them:
    Qwen2 always has q/k/v biases; Llama and Qwen3 have q/k/v/o biases with ``attention_bias`` and Llama
    gate/up/down biases with ``mlp_bias``; Qwen3 has an RMSNorm over ``head_dim`` for q and one for k.
    Biases of column-split layers are split over tp, the rest replicated."""
    extra = ParamGroup()
    if kind == "qwen2" or (kind == "qwen2_moe" and cfg.get("qkv_bias", True)):
        extra += ParamGroup(sharded=q + 2 * kv)
    elif kind in ("llama", "qwen3", "qwen3_moe") and cfg.get("attention_bias"):
        extra += ParamGroup(sharded=q + 2 * kv, replicated=h)
    if kind == "llama" and cfg.get("mlp_bias"):
        extra += ParamGroup(sharded=2 * ffn, replicated=h)
    if kind in ("qwen3", "qwen3_moe"):
        extra += ParamGroup(replicated=2 * head_dim)
    return extra


def _moe_layers(kind: str, cfg: dict[str, Any], n_layers: int) -> list[bool]:
    """Which layers route to experts, as ``transformers`` builds them."""
    if kind == "mixtral":
        return [True] * n_layers
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    experts = int(_get(cfg, "num_local_experts", "num_experts") or 0)
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n_layers)]


def _moe_spec(path: Path, cfg: dict[str, Any], shape: TransformerShape, name: str) -> ModelSpec:
    """A mixture of experts: each MoE layer's router (``experts x dim``), its experts' stacked SwiGLU matrices
    (``3 x experts x dim x moe_hidden``) and Qwen2-MoE's shared expert and its one-output gate in place of the
    dense MLP; the rest as the dense skeleton's."""
    from paratrain.plan.moe import MoEShape

    kind, h = str(cfg["model_type"]), shape.dim
    try:
        # the published configs write num_experts for Qwen; transformers 5 saves num_local_experts for all three
        experts = int(_get(cfg, "num_local_experts", "num_experts") or cfg["num_experts"])
        fe = int(cfg["intermediate_size"] if kind == "mixtral" else cfg["moe_intermediate_size"])
        top_k = int(cfg["num_experts_per_tok"])
    except KeyError as e:
        raise ConfigError(
            f"{path}: the config has no {e.args[0]!r}, which a mixture of experts needs."
        ) from None
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    routed = _moe_layers(kind, cfg, shape.n_layers)
    if not any(routed):
        raise ConfigError(
            f"{path}: the config routes no layer to experts (num_experts, decoder_sparse_step)."
        )
    dense = spec_from_shape(shape, name)
    swap = (
        experts * h + 3 * experts * h * fe + 3 * h * shared + (h if shared else 0) - 3 * h * shape.ffn_hidden
    )
    layers = tuple(
        ParamGroup(g.sharded + swap, g.replicated) if r else g
        for g, r in zip(dense.layers, routed, strict=True)
    )
    total = dense.first.total + sum(g.total for g in layers) + dense.last.total
    expert_matrix = ParamGroup(sharded=2 * fe * h * experts)  # the stacked gate_up_proj
    largest = max(dense.largest_tensor, expert_matrix, key=lambda g: g.total)
    shape_moe = MoEShape(dim=h, n_experts=experts, top_k=top_k, n_shared_experts=shared / fe, moe_hidden=fe,
                         moe_layers=sum(routed), ffn_hidden=shape.ffn_hidden)  # fmt: skip
    arch = {
        "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }
    return replace(dense, num_params=total, layers=layers, largest_tensor=largest, moe=shape_moe, splits=(),
                   arch=arch[kind])  # fmt: skip


def spec_from_hf_config(path: Path, name: str) -> ModelSpec:
    """The planner's spec of the ``config.json`` at ``path``: its shape, and, with untied embeddings, the
    embedding and the final norm + head as FSDP units of their own (as zero3/hsdp wrap an HF model)."""
    shape = shape_from_hf_config(path)
    cfg = _read(path)
    spec = (
        _moe_spec(path, cfg, shape, name)
        if cfg.get("model_type") in MOE_TYPES
        else spec_from_shape(shape, name)
    )
    return replace(spec, embedding_units=not shape.tied_embeddings)
