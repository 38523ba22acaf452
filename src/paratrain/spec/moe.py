"""Mixture-of-experts shapes, torch-free: the MoE presets of :data:`paratrain.spec.llama.PRESETS`, which layers
are MoE, and the checks of the MoE fields of :class:`~paratrain.spec.llama.LlamaConfig`.

``llama-moe-debug`` (tests) and ``llama-moe-small`` (the demo) train on a CPU; the others are shapes for
``paratrain plan``, taken from each release's config, with one approximation: paratrain's attention is
grouped-query attention with ``head_dim = dim / n_heads``, so Qwen3's wider heads (128 x 32 on a 2048
residual) and DeepSeek-V3's multi-head latent attention are approximated (the totals are within 2% of the
published 30.5B and 671B; the counts are asserted in tests):

- ``mixtral-8x7b`` (Jiang et al. 2024, https://arxiv.org/abs/2401.04088): 8 experts, top-2, every layer.
- ``qwen3-30b-a3b`` (Qwen3 technical report, https://arxiv.org/abs/2505.09388): 128 experts, top-8.
- ``deepseek-v3`` (https://arxiv.org/abs/2412.19437): 256 routed + 1 shared expert, top-8, sigmoid scores,
  the first 3 layers dense; 671B parameters, 37B active per token.
"""

from __future__ import annotations

import math
from typing import Any

from paratrain.errors import ConfigError

MOE_PRESETS: dict[str, dict[str, Any]] = {
    # 8 experts, top-2, a shared expert, 4 MoE layers: fast enough for the distributed tests.
    "llama-moe-debug": dict(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192, vocab_size=256, max_seq_len=256,
        n_experts=8, top_k=2, n_shared_experts=1, moe_hidden=64,
    ),
    "llama-moe-small": dict(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=256, max_seq_len=1024,
        n_experts=8, top_k=2, n_shared_experts=1, moe_hidden=512,
    ),
    "mixtral-8x7b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336, vocab_size=32000,
        max_seq_len=32768, rope_theta=1e6, n_experts=8, top_k=2, moe_hidden=14336, bias_update_rate=0.0,
    ),
    "qwen3-30b-a3b": dict(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_hidden=6144, vocab_size=151936,
        max_seq_len=40960, rope_theta=1e6, n_experts=128, top_k=8, moe_hidden=768, bias_update_rate=0.0,
        aux_loss_coef=0.001,
    ),
    "deepseek-v3": dict(
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_hidden=18432, vocab_size=129280,
        max_seq_len=163840, rope_theta=10000.0, n_experts=256, top_k=8, n_shared_experts=1, moe_hidden=2048,
        first_dense_layers=3, router_score="sigmoid", aux_loss_coef=0.0001,
    ),
}  # fmt: skip
"""Keyword arguments of :class:`~paratrain.models.llama.LlamaConfig` per preset."""


def is_moe_layer(cfg: Any, layer: int) -> bool:
    """Whether layer ``layer`` of a Llama config has an MoE feed-forward: after ``first_dense_layers`` dense
    ones, every ``moe_every``-th layer (the first of them included); none when ``n_experts == 0``."""
    if cfg.n_experts == 0 or layer < cfg.first_dense_layers:
        return False
    return bool((layer - cfg.first_dense_layers) % cfg.moe_every == 0)


def check_moe(cfg: Any) -> None:
    """Refuse MoE fields that cannot build a model (:class:`~paratrain.errors.ConfigError`)."""
    for name in ("n_experts", "top_k", "n_shared_experts", "moe_every", "first_dense_layers", "moe_hidden"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"model.{name} must be a non-negative integer, got {value!r}.")
    if not 1 <= cfg.top_k <= cfg.n_experts:
        raise ConfigError(
            f"model.top_k={cfg.top_k} must be between 1 and model.n_experts={cfg.n_experts}: each token goes to "
            "top_k distinct experts."
        )
    if cfg.moe_every < 1:
        raise ConfigError(f"model.moe_every must be at least 1, got {cfg.moe_every}.")
    if cfg.router_score not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.router_score must be 'softmax' or 'sigmoid', got {cfg.router_score!r}.")
    for name in ("capacity_factor", "aux_loss_coef", "bias_update_rate"):
        value = getattr(cfg, name)
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"model.{name} must be a finite number >= 0, got {value!r}.")
