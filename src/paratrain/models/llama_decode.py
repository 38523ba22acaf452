"""Incremental decoding for :class:`~paratrain.models.llama.Llama` with a key/value cache.

Sampling one token at a time with a plain forward pass recomputes every earlier position at every step
(quadratic work). Here the prompt is run once (the *prefill*), each layer keeps its rotated keys and values,
and each new token runs only its own position, attending to the cached keys and values (the standard KV
cache of autoregressive transformers; e.g. Pope et al., "Efficiently Scaling Transformer Inference", 2022).

The arithmetic is the model's own: the same modules (projections, norms, feed-forward), the same rotary
tables at the token's absolute position, the same grouped-query repeat and SDPA. It holds while the whole
sequence fits the rotary table (``max_seq_len``); past that, :mod:`paratrain.train.generate` falls back to
the model's forward over the last ``max_seq_len`` tokens, as it did without a cache.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from paratrain.models.llama import Llama, TransformerBlock, apply_rope

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer: keys and values ``[batch, kv_heads, positions so far, head_dim]``, rotated keys."""


@torch.no_grad()
def forward_cached(model: Llama, tokens: torch.Tensor, cache: KV) -> torch.Tensor:
    """Logits ``[b, s, vocab]`` of ``tokens [b, s]`` placed after the positions already in ``cache``
    (empty: a prefill from position 0), appending their keys and values to ``cache``. A call with ``s > 1``
    on a non-empty cache is not supported (prefill, then one token at a time)."""
    start = cache[0][0].shape[2] if cache else 0
    b, s = tokens.shape
    if start and s != 1:
        raise ValueError("forward_cached: after the prefill, decode one token at a time")
    if start + s > model.freqs_cos.shape[0]:
        raise ValueError(f"forward_cached: position {start + s} is past model.max_seq_len")
    assert model.tok_embeddings is not None and model.output is not None, (
        "a whole model, not a pipeline stage"
    )
    cos, sin = model.freqs_cos[start : start + s], model.freqs_sin[start : start + s]
    h = model.tok_embeddings(tokens)
    blocks = cast(list[TransformerBlock], list(model.layers.values()))
    for i, layer in enumerate(blocks):
        att = layer.attention
        x = layer.attention_norm(h)
        q = att.wq(x).view(b, s, -1, att.head_dim)
        k = att.wk(x).view(b, s, -1, att.head_dim)
        v = att.wv(x).view(b, s, -1, att.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if start:
            k, v = torch.cat((cache[i][0], k), dim=2), torch.cat((cache[i][1], v), dim=2)
            cache[i] = (k, v)
        else:
            cache.append((k, v))
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # the prefill is causal; one new token attends to every cached position
        out = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and s > 1)
        h = h + att.wo(out.transpose(1, 2).reshape(b, s, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    if model.norm is not None:
        h = model.norm(h)
    return model.output(h)
