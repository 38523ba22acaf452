"""A Llama-style decoder-only transformer, written to be read top to bottom.

The architecture is Llama 2/3's (Touvron et al. 2023, https://arxiv.org/abs/2307.09288; Meta's Llama 3 report,
https://arxiv.org/abs/2407.21783): pre-norm blocks with RMSNorm (Zhang & Sennrich 2019), rotary position
embeddings (Su et al. 2021, https://arxiv.org/abs/2104.09864), a SwiGLU MLP (Shazeer 2020,
https://arxiv.org/abs/2002.05202) and grouped-query attention (Ainslie et al. 2023,
https://arxiv.org/abs/2305.13245), computed with causal ``F.scaled_dot_product_attention``. No biases.

Module names are the ones Meta's checkpoints and torchtitan use, because the parallel code addresses
modules by name::

    tok_embeddings                      nn.Embedding(vocab_size, dim)
    layers.{i}.attention_norm           RMSNorm
    layers.{i}.attention.wq/wk/wv/wo    nn.Linear: tensor parallel shards wq/wk/wv colwise, wo rowwise
    layers.{i}.ffn_norm                 RMSNorm
    layers.{i}.feed_forward.w1/w3/w2    nn.Linear: w1/w3 colwise, w2 rowwise
    norm                                RMSNorm
    output                              nn.Linear(dim, vocab_size), its weight tied to tok_embeddings when
                                        ``tie_embeddings``

**Why ``layers`` is an ``nn.ModuleDict`` and ``blocks`` a view of it.** A pipeline stage is made by
deleting the layers that live on other stages (``del model.layers["5"]``) and setting ``tok_embeddings``,
``norm`` or ``output`` to ``None``. With a ModuleDict keyed ``"0".."n-1"`` the surviving layers keep their
original names (``layers.7.attention.wq.weight`` on every stage), so Distributed Checkpoint saves and loads
every layout under one set of names; a ModuleList would renumber them from 0. The rest of paratrain
(activation checkpointing, per-block FSDP units) works on ``model.blocks``, an ``nn.ModuleList``; here
``blocks`` is a property that returns a fresh list view of ``layers`` (it is not registered, so no name
appears twice). Assigning ``model.blocks[i] = wrapper(block)`` writes through into ``layers``.

**Attention under tensor parallelism.** The number of heads a module computes is read from the width of
``wq``'s output (``wq(x).shape[-1] // head_dim``), not from the config. After ``parallelize_module`` shards
wq/wk/wv colwise with ``use_local_output=True``, each rank sees only its local heads and the same code runs.

**Init.** :meth:`Llama.init_weights` draws every weight from the global torch RNG in a fixed module order,
so the values depend on the seed only, never on the world size, as long as it runs on the full model before
it is sharded or split. The rotary tables are non-persistent buffers (they are not in checkpoints) and
``init_weights(buffer_device)`` recomputes them, so the model can be built on the meta device, moved with
``to_empty(device=...)`` and then initialised (torchtitan's flow).

Named configurations are in :data:`PRESETS`. The large ones (``llama2-*``, ``llama3-*``) are shapes for the
planner: :func:`build_llama` builds them on the meta device only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratrain.spec.llama import (
    PRESETS,
    SHAPE_ONLY_PRESETS,
    LlamaConfig,
    check_trainable,
    count_params,
    flops_per_token,
    resolve_config,
)

__all__ = [
    "PRESETS",
    "SHAPE_ONLY_PRESETS",
    "Attention",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "build_llama",
    "check_trainable",
    "count_params",
    "flops_per_token",
    "precompute_rope",
    "resolve_config",
]


# ---------------------------------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, computed in float32 and cast back (no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables ``cos, sin``, each ``[max_seq_len, head_dim // 2]`` in float32.

    Channel pair ``j`` at position ``m`` is rotated by the angle ``m * theta^(-2j / head_dim)``.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [batch, seq, heads, head_dim]`` by the angles of positions ``0..seq-1``.

    Channels ``(2j, 2j+1)`` form a 2-D vector that is rotated by a position-dependent angle (the pairing of
    Meta's reference code, so its checkpoints load unchanged). A rotation keeps the norm, and the dot
    product of a query rotated to position ``m`` with a key rotated to ``n`` depends on ``m - n`` only.
    """
    seq = x.shape[1]
    c = cos[:seq].view(1, seq, 1, -1)
    s = sin[:seq].view(1, seq, 1, -1)
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    return rotated.type_as(x)  # the tables are float32; keep the activation dtype (bf16 under autocast)


class Attention(nn.Module):
    """Causal grouped-query self-attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism wq/wk/wv hold this rank's heads only, so count them from the
        # projection's width instead of trusting the config.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [b, heads, s, head_dim]
        # Key/value head j serves query heads j*group .. (j+1)*group-1. A colwise shard of wq and wk keeps
        # whole groups together on one rank, so the local repeat is the global one.
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``."""

    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = FeedForward(cfg.dim, cfg.ffn_hidden)
        if cfg.n_experts:
            from paratrain.models.moe import MoE
            from paratrain.spec.moe import is_moe_layer

            if is_moe_layer(cfg, layer):
                self.feed_forward = MoE(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class _LayerListView(nn.ModuleList):
    """The values of a ModuleDict as a ModuleList; ``view[i] = m`` also replaces the entry in the dict."""

    _owner: nn.ModuleDict
    _keys: list[str]

    def __init__(self, layers: nn.ModuleDict) -> None:
        super().__init__(layers.values())
        # Plain attributes (not submodules): the view must not register the dict a second time.
        object.__setattr__(self, "_owner", layers)
        object.__setattr__(self, "_keys", list(layers.keys()))

    def __setitem__(self, idx: int, module: nn.Module) -> None:  # type: ignore[override]
        super().__setitem__(idx, module)
        self._owner[self._keys[idx]] = module


# ---------------------------------------------------------------------------------------------- model
class Llama(nn.Module):
    """``model(tokens [b, s]) -> logits [b, s, vocab_size]``.

    A pipeline stage is this model with some modules deleted: with ``tok_embeddings is None`` the input is
    the hidden states ``[b, s, dim]`` from the previous stage; with ``output is None`` (and ``norm`` is
    None) the result is the hidden states for the next stage. Tied embeddings cannot be split across stages.
    """

    freqs_cos: torch.Tensor
    freqs_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        target = torch.get_default_device()
        # Build on meta, then materialise and initialise once: PyTorch's per-layer default inits would
        # consume the global RNG first, and then a CPU build and a meta build + to_empty + init_weights
        # from the same seed would give different weights.
        with torch.device("meta"):
            self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
            self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
            cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self._tie()
        # Non-persistent: derived from the config, so they stay out of checkpoints and state_dict().
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)
        if target.type != "meta":
            self.to_empty(device=target)
        self.init_weights()

    def _tie(self) -> None:
        emb, out = self.tok_embeddings, self.output
        if (
            self.config.tie_embeddings
            and emb is not None
            and out is not None
            and out.weight is not emb.weight
        ):
            out.weight = emb.weight

    def _apply(self, fn: Any, recurse: bool = True) -> Llama:
        # A move that makes new tensors (meta -> cpu in ``to_empty``) gives each module its own copy of a
        # shared parameter, which would silently untie the embeddings: tie them again afterwards.
        super()._apply(fn, recurse)
        self._tie()
        return self

    @property
    def blocks(self) -> nn.ModuleList:
        """The transformer blocks present on this model, in layer order, as a write-through list view."""
        return _LayerListView(self.layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.freqs_cos.shape[0]:
            raise ValueError(
                f"sequence length {seq} exceeds model.max_seq_len={self.freqs_cos.shape[0]}: "
                "raise model.max_seq_len or lower --seq-len"
            )
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cos, self.freqs_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)initialise the parameters and recompute the rotary buffers.

        Every weight matrix is drawn from ``N(0, init_std^2)``, except the projections that write into the
        residual stream (``wo``, ``w2``), whose std is divided by ``sqrt(2 * n_layers)`` so the residual's
        variance does not grow with depth (GPT-2, Radford et al. 2019). Norm weights are 1. The draws come
        from the global RNG in a fixed order: ``tok_embeddings``, then each present layer in index order
        (``wq, wk, wv, wo, w1, w2, w3``), then ``output`` (skipped when tied). On the meta device nothing is
        drawn; the buffers are rebuilt on ``buffer_device`` (default: where they are now).
        """
        cfg = self.config
        device = buffer_device if buffer_device is not None else self.freqs_cos.device
        cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device)
        self.freqs_cos, self.freqs_sin = cos, sin  # replaces the registered buffers (still non-persistent)

        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers.values():
            block: TransformerBlock = _unwrap(layer)
            attn, ffn = block.attention, block.feed_forward
            for lin, s in ((attn.wq, std), (attn.wk, std), (attn.wv, std), (attn.wo, out_std)):
                nn.init.normal_(lin.weight, std=s)
            if isinstance(ffn, FeedForward):
                for lin, s in ((ffn.w1, std), (ffn.w2, out_std), (ffn.w3, std)):
                    nn.init.normal_(lin.weight, std=s)
            else:  # an MoE block (paratrain.models.moe): gate, experts, shared expert
                ffn.init_weights(std, out_std)  # type: ignore[operator]
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not cfg.tie_embeddings:
            nn.init.normal_(self.output.weight, std=std)


def _unwrap(module: nn.Module) -> Any:
    """The block inside an activation-checkpoint wrapper (or the module itself)."""
    return getattr(module, "_checkpoint_wrapped_module", module)


def build_llama(
    name_or_config: str | LlamaConfig,
    overrides: Mapping[str, Any] | None = None,
    *,
    device: torch.device | str | None = None,
    allow_large: bool = False,
) -> Llama:
    """Build a preset (or ``LlamaConfig``) with field ``overrides`` such as ``{"n_layers": 2}``.

    The model is created on ``device`` (default: the current default device, so ``with
    torch.device("meta"):`` works) and initialised from the global RNG. A shape-only preset
    (:data:`SHAPE_ONLY_PRESETS`) is refused off the meta device unless ``allow_large=True``.
    """
    cfg = resolve_config(name_or_config, overrides)
    target = torch.device(device) if device is not None else torch.get_default_device()
    if isinstance(name_or_config, str) and target.type != "meta" and not allow_large:
        check_trainable(name_or_config, cfg)
    with torch.device(target):
        return Llama(cfg)


