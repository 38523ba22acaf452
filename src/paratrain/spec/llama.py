"""The shape of paratrain's Llama, torch-free: its config, the named presets, parameter and FLOP counts.

The model itself is :mod:`paratrain.models.llama`; the planner, the launcher's checks and ``paratrain plan``
read the shapes from here without importing torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paratrain.config import convert
from paratrain.errors import ConfigError, suggest
from paratrain.spec.moe import MOE_PRESETS, check_moe, is_moe_layer

__all__ = [
    "PRESETS",
    "SHAPE_ONLY_PRESETS",
    "LlamaConfig",
    "check_trainable",
    "count_params",
    "flops_per_token",
    "resolve_config",
]


@dataclass
class LlamaConfig:
    """The shape of a Llama model. Every field can be set with ``--set model.FIELD=VALUE``."""

    dim: int = 64
    """Width of the residual stream (the hidden size)."""
    n_layers: int = 6
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer; ``head_dim = dim // n_heads``."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); must divide ``n_heads``. Equal to ``n_heads`` is MHA."""
    ffn_hidden: int = 192
    """Hidden width of the SwiGLU MLP (the output width of w1 and w3)."""
    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level tokenizer."""
    max_seq_len: int = 256
    """Longest sequence the rotary tables cover."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square in RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (10000 in Llama 2, 500000 in Llama 3)."""
    tie_embeddings: bool = False
    """Share one matrix between ``tok_embeddings`` and ``output``."""
    init_std: float = 0.02
    """Standard deviation of the normal init; ``wo`` and ``w2`` use ``init_std / sqrt(2 * n_layers)``."""
    # ---- mixture of experts (paratrain.models.moe); n_experts = 0 is a dense model
    n_experts: int = 0
    """Routed experts of each MoE layer; 0: every layer has the dense SwiGLU MLP."""
    top_k: int = 2
    """Experts each token is sent to."""
    n_shared_experts: int = 0
    """Always-on shared experts (one SwiGLU of width ``n_shared_experts * moe_hidden``)."""
    moe_every: int = 1
    """MoE in every ``moe_every``-th layer (after ``first_dense_layers``), dense elsewhere."""
    first_dense_layers: int = 0
    """Leading layers that stay dense (DeepSeek-V3: 3)."""
    moe_hidden: int = 0
    """Hidden width of each expert; 0: ``ffn_hidden``."""
    capacity_factor: float = 0.0
    """0: dropless. Otherwise an expert takes at most ``ceil(capacity_factor * tokens * top_k / n_experts)``
    assignments per forward on one rank; the rest are dropped."""
    router_score: str = "softmax"
    """``softmax`` or ``sigmoid`` scores of the gate."""
    router_renorm: bool = True
    """Renormalise the chosen experts' weights to sum to 1."""
    aux_loss_coef: float = 0.0
    """Coefficient of the sequence-level balance loss added to the training loss (0: none)."""
    bias_update_rate: float = 1e-3
    """Step of the auxiliary-loss-free expert bias per optimizer step (0: the bias stays 0)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model.{name} must be a positive integer, got {value!r}.")
        if self.dim % self.n_heads:
            raise ConfigError(
                f"model.dim={self.dim} is not divisible by model.n_heads={self.n_heads}: "
                "pick n_heads that divides dim."
            )
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model.n_heads={self.n_heads} is not divisible by model.n_kv_heads={self.n_kv_heads}: "
                "each key/value head serves a whole group of query heads."
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head_dim = dim / n_heads = {self.head_dim} is odd; rotary embeddings rotate pairs of "
                "channels, so it must be even."
            )
        if self.norm_eps <= 0 or self.rope_theta <= 0 or self.init_std <= 0:
            raise ConfigError(
                "model.norm_eps, model.rope_theta and model.init_std must be positive, got "
                f"{self.norm_eps!r}, {self.rope_theta!r}, {self.init_std!r}."
            )

        if self.n_experts:
            check_moe(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


# ---------------------------------------------------------------------------------------------- presets
# Large shapes are Meta's published ones (params.json of each release); the counts are asserted in tests.
PRESETS: dict[str, LlamaConfig] = {
    # 328,512 parameters: fast enough for every unit and distributed test.
    "llama-debug": LlamaConfig(
        dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=256, max_seq_len=256
    ),
    # 25,436,672 parameters with the byte vocabulary (29,368,832 with --set data.tokenizer=bpe:4096).
    "llama-small": LlamaConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, vocab_size=256, max_seq_len=1024
    ),
    "llama2-7b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008, vocab_size=32000, max_seq_len=4096
    ),
    "llama2-13b": LlamaConfig(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden=13824, vocab_size=32000, max_seq_len=4096
    ),
    "llama2-70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, vocab_size=32000, max_seq_len=4096
    ),
    "llama3-8b": LlamaConfig(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-405b": LlamaConfig(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_hidden=53248,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}
PRESETS.update({name: LlamaConfig(**kw) for name, kw in MOE_PRESETS.items()})
SHAPE_ONLY_PRESETS: frozenset[str] = frozenset(
    {"llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b", "mixtral-8x7b",
     "qwen3-30b-a3b", "deepseek-v3"}
)  # fmt: skip
"""Presets for ``paratrain plan`` and memory accounting: :func:`build_llama` builds them on meta only."""


def count_params(cfg: LlamaConfig, include_embedding: bool = True, active: bool = False) -> int:
    """The parameter count of ``cfg`` by arithmetic (equal to the built model's; no model is built).

    ``include_embedding=False`` leaves out the input embedding table but keeps the output head; with tied
    embeddings the one shared matrix is counted once, as the head. ``active=True`` counts, in MoE layers, the
    ``top_k`` experts a token runs through instead of all of them.
    """
    kv = cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * cfg.dim * 2 + cfg.dim * kv * 2  # wq, wo + wk, wv
    mlp = 3 * cfg.dim * cfg.ffn_hidden
    moe = mlp
    if cfg.n_experts:
        expert = 3 * cfg.dim * (cfg.moe_hidden or cfg.ffn_hidden)
        routed = cfg.top_k if active else cfg.n_experts
        moe = cfg.dim * cfg.n_experts + expert * (routed + cfg.n_shared_experts)  # gate + experts + shared
    n_moe = sum(is_moe_layer(cfg, i) for i in range(cfg.n_layers)) if cfg.n_experts else 0
    per_layer = attention + 2 * cfg.dim  # + two RMSNorm weights
    embedding = cfg.vocab_size * cfg.dim
    head = embedding  # the output matrix; shared with the embedding when tied
    total = cfg.n_layers * per_layer + (cfg.n_layers - n_moe) * mlp + n_moe * moe
    total += cfg.dim + head + (0 if cfg.tie_embeddings else embedding)
    if not include_embedding and not cfg.tie_embeddings:
        total -= embedding
    return total


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) for MFU, in the PaLM convention.

    ``6 * N + 12 * L * H * Q * T`` (Chowdhery et al. 2022, https://arxiv.org/abs/2204.02311, appendix B):

    - ``6 * N``: each weight does one multiply-add (2 FLOPs) per token in forward and two in backward.
      ``N`` counts every weight that takes part in a matmul: all parameters except the input embedding
      table, whose lookup costs no FLOPs. The output head counts, tied or not (torchtitan counts the same).
    - ``12 * L * H * Q * T``: the attention scores ``QK^T`` and the weighted sum ``AV``, with ``L`` layers,
      ``H`` query heads of size ``Q`` and ``T = seq_len`` keys per query; counted over the full ``T x T``
      square although the causal mask skips half, as PaLM (and most MFU reports) do.
    """
    n_matmul = count_params(cfg, include_embedding=False, active=True)
    return float(6 * n_matmul + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len)


def _apply_overrides(cfg: LlamaConfig, overrides: Mapping[str, Any]) -> LlamaConfig:
    fields = {f.name: f for f in dataclasses.fields(LlamaConfig)}
    values: dict[str, Any] = {}
    for key, value in overrides.items():
        name = key.removeprefix("model.")
        if name not in fields:
            raise ConfigError(f"unknown Llama field model.{name}. {suggest(name, fields)}")
        values[name] = _coerce(name, value, getattr(cfg, name))
    return dataclasses.replace(cfg, **values)


def _coerce(name: str, value: Any, current: Any) -> Any:
    """``"128"`` -> 128 for an int field (``--set`` values may arrive as text): the config's own coercer."""
    return convert(value, type(current), f"model.{name}")


def resolve_config(
    name_or_config: str | LlamaConfig, overrides: Mapping[str, Any] | None = None
) -> LlamaConfig:
    """A preset name (or a config) with ``overrides`` applied and validated."""
    if isinstance(name_or_config, LlamaConfig):
        cfg = name_or_config
    elif name_or_config in PRESETS:
        cfg = PRESETS[name_or_config]
    else:
        raise ConfigError(f"unknown Llama preset {name_or_config!r}. {suggest(name_or_config, PRESETS)}")
    return _apply_overrides(cfg, overrides or {})


def check_trainable(name: str, cfg: LlamaConfig) -> None:
    """Refuse a shape-only preset (:data:`SHAPE_ONLY_PRESETS`) for training: the launching process calls this
    on the meta model's config, so the run is refused before launch rather than in every worker."""
    if name in SHAPE_ONLY_PRESETS:
        raise ConfigError(
            f"model {name!r} ({count_params(cfg) / 1e9:.1f}B parameters) is a shape-only preset "
            "for `paratrain plan` and memory accounting; it is built on the meta device only. "
            "Train llama-debug or llama-small instead, or build it with device='meta'."
        )
