"""``generate``'s KV cache: incremental decoding of a Llama gives the logits of the full forward at every
position, and the same tokens (greedy and sampled), also past ``max_seq_len`` where it falls back to the
full forward over the last ``max_seq_len`` ids."""

from __future__ import annotations

import pytest
import torch

from paratrain.models.llama import build_llama
from paratrain.models.llama_decode import forward_cached
from paratrain.train.generate import _next_logits


def _model(max_seq_len: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    # grouped-query attention (2 kv heads for 4 query heads): the cache holds the kv heads before the repeat
    model = build_llama(
        "llama-debug", {"vocab_size": 50, "max_seq_len": max_seq_len, "n_heads": 4, "n_kv_heads": 2}
    )
    return model.eval()


@torch.no_grad()
def test_cached_logits_equal_the_full_forward() -> None:
    model = _model()
    ids = torch.randint(0, 50, (1, 20), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache: list = []
    got = [forward_cached(model, ids[:, :5], cache)]  # prefill
    got += [forward_cached(model, ids[:, t : t + 1], cache) for t in range(5, 20)]
    torch.testing.assert_close(torch.cat(got, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache[0][0].shape == (1, 2, 20, model.config.head_dim)


def _decode(model: torch.nn.Module, kv: bool, steps: int, limit: int, temperature: float) -> list[int]:
    f = _next_logits(model, limit, kv)
    gen = torch.Generator().manual_seed(3)
    out = [1, 2, 3]
    with torch.no_grad():
        for _ in range(steps):
            logits = f(out)
            if temperature == 0:
                out.append(int(logits.argmax()))
            else:
                out.append(int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_same_tokens_with_and_without_the_cache(temperature: float) -> None:
    model = _model(max_seq_len=16)  # 3 + 30 tokens: the last 17 are past the table (the fallback)
    with_cache = _decode(model, True, 30, 16, temperature)
    assert with_cache == _decode(model, False, 30, 16, temperature)
    assert len(set(with_cache)) > 3  # not a degenerate constant sequence
