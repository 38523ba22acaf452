"""The Llama model: preset shapes, causality, GQA against a hand-written reference, RoPE, init, stages."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from paratrain.errors import ConfigError
from paratrain.models.llama import (
    PRESETS,
    SHAPE_ONLY_PRESETS,
    Attention,
    Llama,
    LlamaConfig,
    TransformerBlock,
    apply_rope,
    build_llama,
    count_params,
    flops_per_token,
    precompute_rope,
)

EXPECTED_PARAMS = {
    "llama-debug": 328_512,
    "llama-small": 25_436_672,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


def _block(model: Llama, i: int) -> TransformerBlock:
    block = model.layers[str(i)]
    assert isinstance(block, TransformerBlock)
    return block


def _debug(seed: int = 0, **overrides: object) -> Llama:
    torch.manual_seed(seed)
    return build_llama("llama-debug", overrides)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_preset_parameter_counts_on_meta(name: str) -> None:
    if name in SHAPE_ONLY_PRESETS:
        model = build_llama(name, device="meta")
    else:
        with torch.device("meta"):
            model = build_llama(name)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == EXPECTED_PARAMS[name]
    assert count_params(PRESETS[name]) == EXPECTED_PARAMS[name]


def test_llama_small_with_a_4096_token_bpe_has_the_count_its_comment_gives() -> None:
    model = build_llama("llama-small", {"vocab_size": 4096}, device="meta")  # --set data.tokenizer=bpe:4096
    assert sum(p.numel() for p in model.parameters()) == 29_368_832


def test_debug_and_small_sizes() -> None:
    assert PRESETS["llama-debug"].n_layers == 6
    assert count_params(PRESETS["llama-debug"]) < 1_000_000
    assert 20e6 <= count_params(PRESETS["llama-small"]) <= 30e6
    assert 20e6 <= count_params(dataclasses.replace(PRESETS["llama-small"], vocab_size=4096)) <= 30e6


@pytest.mark.parametrize("name", sorted(SHAPE_ONLY_PRESETS))
def test_shape_only_presets_refuse_to_materialize(name: str) -> None:
    with pytest.raises(ConfigError, match="shape-only preset for `paratrain plan`"):
        build_llama(name)


def test_overrides_and_config_errors() -> None:
    with torch.device("meta"):
        model = build_llama("llama-debug", {"n_layers": "2", "model.dim": 128, "tie_embeddings": "true"})
    assert (model.config.n_layers, model.config.dim, model.config.tie_embeddings) == (2, 128, True)
    with pytest.raises(ConfigError, match="Did you mean 'n_heads'"):
        build_llama("llama-debug", {"n_head": 8})
    with pytest.raises(ConfigError, match="not divisible by model.n_kv_heads"):
        LlamaConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="model.dim=66 is not divisible"):
        LlamaConfig(dim=66, n_heads=4)
    with pytest.raises(ConfigError, match="Did you mean 'llama-debug'"):
        build_llama("llama-dbug")


def test_forward_shapes_and_names() -> None:
    model = _debug()
    tokens = torch.randint(0, 256, (2, 16))
    assert model(tokens).shape == (2, 16, 256)
    names = set(model.state_dict())
    assert {
        "tok_embeddings.weight",
        "layers.5.attention.wq.weight",
        "layers.0.feed_forward.w3.weight",
    } <= names
    assert {"norm.weight", "output.weight"} <= names
    assert not any("freqs" in n for n in names)  # rotary tables are not checkpointed
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_causal_changing_a_token_leaves_earlier_logits() -> None:
    model = _debug()
    tokens = torch.randint(0, 256, (1, 24))
    changed = tokens.clone()
    t = 10
    changed[0, t] = (tokens[0, t] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t], b[:, t])


def _reference_attention(
    attn: Attention, x: torch.Tensor, n_heads: int, n_kv: int, theta: float
) -> torch.Tensor:
    """Grouped-query attention written out: complex RoPE, one query head at a time, explicit causal mask."""
    b, s, _ = x.shape
    d = attn.head_dim
    q = (x @ attn.wq.weight.T).view(b, s, n_heads, d)
    k = (x @ attn.wk.weight.T).view(b, s, n_kv, d)
    v = (x @ attn.wv.weight.T).view(b, s, n_kv, d)
    freqs = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    rot = torch.polar(
        torch.ones(s, d // 2, dtype=torch.float64), torch.outer(torch.arange(s).double(), freqs)
    )

    def rope(t: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(t.double().reshape(*t.shape[:-1], d // 2, 2).contiguous())
        return torch.view_as_real(pairs * rot[None, :, None, :]).flatten(-2)

    q, k = rope(q), rope(k)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    heads = []
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)  # kv head j serves query heads j*group .. (j+1)*group - 1
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(d)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        heads.append(probs @ v[:, :, kv].double())
    return torch.cat(heads, dim=-1).float() @ attn.wo.weight.T


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_gqa_matches_reference(n_kv: int) -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=32, n_heads=4, n_kv_heads=n_kv, rope_theta=100.0)
    attn = Attention(cfg)
    x = torch.randn(2, 12, 32)
    cos, sin = precompute_rope(cfg.head_dim, 32, cfg.rope_theta)
    expected = _reference_attention(attn, x, 4, n_kv, cfg.rope_theta)
    torch.testing.assert_close(attn(x, cos, sin), expected, rtol=1e-4, atol=1e-5)


def test_attention_counts_local_heads_from_wq_like_tensor_parallel() -> None:
    """Colwise shards of wq/wk/wv and a rowwise shard of wo, per rank; the partial outputs sum to the full."""
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2)
    full = Attention(cfg)
    x = torch.randn(2, 8, 64)
    cos, sin = precompute_rope(cfg.head_dim, 16, cfg.rope_theta)
    tp, d = 2, cfg.head_dim
    total = torch.zeros(2, 8, 64)
    for r in range(tp):
        local = copy.deepcopy(full)
        q_rows = slice(r * 2 * d, (r + 1) * 2 * d)  # 2 of 4 query heads
        kv_rows = slice(r * d, (r + 1) * d)  # 1 of 2 kv heads
        with torch.no_grad():
            local.wq.weight = torch.nn.Parameter(full.wq.weight[q_rows].clone())
            local.wk.weight = torch.nn.Parameter(full.wk.weight[kv_rows].clone())
            local.wv.weight = torch.nn.Parameter(full.wv.weight[kv_rows].clone())
            local.wo.weight = torch.nn.Parameter(full.wo.weight[:, q_rows].clone())
        total += local(x, cos, sin)
    torch.testing.assert_close(total, full(x, cos, sin), rtol=1e-5, atol=1e-6)


def test_tied_embeddings_share_storage() -> None:
    model = _debug(tie_embeddings=True)
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == count_params(model.config) == 328_512 - 256 * 64
    with torch.device("meta"):
        meta = build_llama("llama-debug", {"tie_embeddings": True})
    meta.to_empty(device="cpu")  # makes new tensors per module: the model ties them again
    assert meta.output is not None and meta.tok_embeddings is not None
    assert meta.output.weight is meta.tok_embeddings.weight


def test_init_depends_on_the_seed_only() -> None:
    a, b, c = _debug(seed=3), _debug(seed=3), _debug(seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(_block(a, 0).attention.wq.weight, _block(c, 0).attention.wq.weight)
    # Meta build + to_empty + init_weights (the sharded-training flow) gives the same weights.
    with torch.device("meta"):
        meta = build_llama("llama-debug")
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    for (name, pa), pm in zip(a.named_parameters(), meta.parameters(), strict=True):
        assert torch.equal(pa, pm), name
    torch.testing.assert_close(meta.freqs_cos, a.freqs_cos)


def test_init_scheme() -> None:
    torch.manual_seed(0)
    model = build_llama("llama-debug", {"dim": 256, "ffn_hidden": 512, "n_layers": 8})
    std = model.config.init_std
    block = _block(model, 3)
    assert abs(block.attention.wq.weight.std().item() - std) < 0.05 * std
    out_std = std / math.sqrt(2 * 8)
    assert abs(block.attention.wo.weight.std().item() - out_std) < 0.05 * out_std
    assert abs(block.feed_forward.w2.weight.std().item() - out_std) < 0.05 * out_std
    assert torch.equal(block.ffn_norm.weight, torch.ones(256))


def test_rope_preserves_norm_and_depends_on_relative_position() -> None:
    torch.manual_seed(0)
    d, s = 16, 20
    cos, sin = precompute_rope(d, s, 10000.0)
    x = torch.randn(1, s, 3, d)
    torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))
    q, k = torch.randn(d), torch.randn(d)
    q_rot = apply_rope(q.expand(1, s, 1, d), cos, sin)[0, :, 0]
    k_rot = apply_rope(k.expand(1, s, 1, d), cos, sin)[0, :, 0]
    for gap in (0, 3, 7):
        dots = torch.stack([q_rot[m] @ k_rot[m - gap] for m in range(gap, s)])
        torch.testing.assert_close(dots, dots[0].expand_as(dots), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(q_rot[5] @ k_rot[2], q_rot[5] @ k_rot[4])


def test_pipeline_stages_chain_to_the_full_model() -> None:
    model = _debug()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for i in range(3, 6):
        del first.layers[str(i)]
    first.norm, first.output = None, None
    for i in range(3):
        del last.layers[str(i)]
    last.tok_embeddings = None
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, 64)
        torch.testing.assert_close(last(hidden), model(tokens), rtol=0, atol=0)
    assert "layers.4.attention.wq.weight" in last.state_dict()  # original names survive
    assert not any(k.startswith("layers.4") for k in first.state_dict())
    assert len(first.blocks) == len(last.blocks) == 3


def test_blocks_is_a_write_through_view() -> None:
    model = _debug()
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        ref = model(tokens)
    blocks = model.blocks
    assert isinstance(blocks, torch.nn.ModuleList) and len(blocks) == 6
    assert all(a is b for a, b in zip(blocks, model.layers.values(), strict=True))
    for i, block in enumerate(blocks):
        blocks[i] = checkpoint_wrapper(block)
    assert type(model.layers["2"]).__name__ == "CheckpointWrapper"
    assert sum(p.numel() for p in model.parameters()) == 328_512  # nothing registered twice
    out = model(tokens)
    out.sum().backward()
    torch.testing.assert_close(out.detach(), ref)
    model.init_weights()  # still finds the blocks inside the wrappers


def test_flops_per_token_formula() -> None:
    cfg = PRESETS["llama2-7b"]
    n = 6_738_415_616 - 32000 * 4096  # no input embedding table; the output head counts
    assert flops_per_token(cfg, 4096) == 6 * n + 12 * 32 * 32 * 128 * 4096
    tied = dataclasses.replace(PRESETS["llama-debug"], tie_embeddings=True)
    assert flops_per_token(tied, 256) == 6 * count_params(tied) + 12 * 6 * 4 * 16 * 256


def test_bf16_autocast_keeps_dtypes_consistent() -> None:
    model = _debug()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randint(0, 256, (1, 8)))
    assert out.dtype == torch.bfloat16
