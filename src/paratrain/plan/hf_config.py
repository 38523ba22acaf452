"""The shape of a Hugging Face model from its ``config.json`` alone: ``paratrain plan --model hf:DIR``.

No weights, no ``transformers``, no torch: the JSON is read here and mapped onto
:class:`~paratrain.plan.model.TransformerShape`, so a Llama 3 405B or any other published dense decoder can
be planned on a laptop. Llama, Qwen2/Qwen3 and Mistral map to ``arch="llama"`` (RMSNorm, SwiGLU MLP of
``intermediate_size``, grouped-query attention, rotary positions); GPT-2 to ``arch="gpt"`` (LayerNorm, GeLU
MLP of ``n_inner`` or 4·``n_embd``, biases, learned positions, tied head). What the shape does not model is
small: Qwen2's q/k/v biases, Qwen3's per-head q/k norms, and a ``head_dim`` other than ``hidden / heads``
is counted as ``hidden / heads``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError
from paratrain.plan.model import TransformerShape

__all__ = ["LLAMA_LIKE", "hf_config_path", "shape_from_hf_config"]

LLAMA_LIKE = ("llama", "qwen2", "qwen3", "mistral")
"""``model_type`` values planned as ``arch="llama"``."""


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


def shape_from_hf_config(path: Path) -> TransformerShape:
    """The :class:`TransformerShape` of the ``config.json`` at ``path`` (refused, naming it, when the model
    type is not a dense decoder the planner models)."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({e}).") from None
    kind = str(cfg.get("model_type", ""))
    if kind == "gpt2":
        dim = int(cfg["n_embd"])
        return TransformerShape(
            dim=dim, n_layers=int(cfg["n_layer"]), n_heads=int(cfg["n_head"]), n_kv_heads=int(cfg["n_head"]),
            ffn_hidden=int(cfg.get("n_inner") or 4 * dim), vocab_size=int(cfg["vocab_size"]),
            max_seq_len=int(cfg.get("n_positions") or 1024), arch="gpt", tied_embeddings=True,
        )  # fmt: skip
    if kind not in LLAMA_LIKE:
        raise ConfigError(
            f"{path}: model_type {kind!r} is not one the planner models from a config (dense "
            f"{', '.join(LLAMA_LIKE)} and gpt2). Plan it with --params N (states only)."
        )
    heads = int(cfg["num_attention_heads"])
    try:
        return TransformerShape(
            dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]), n_heads=heads,
            n_kv_heads=int(_get(cfg, "num_key_value_heads") or heads), ffn_hidden=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]), max_seq_len=int(_get(cfg, "max_position_embeddings") or 4096),
            arch="llama", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )  # fmt: skip
    except KeyError as e:
        raise ConfigError(f"{path}: the config has no {e.args[0]!r}, which the shape needs.") from None
