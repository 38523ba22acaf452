"""The MoE block on one process: routing tables, grouped GEMM against the loop, capacity, balancing, presets."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.errors import ConfigError
from paratrain.models.llama import PRESETS, SHAPE_ONLY_PRESETS, LlamaConfig, build_llama, count_params
from paratrain.models.moe import MoE, after_optimizer_step, pop_aux_loss, route_tables, sequence_aux_loss

pytestmark = pytest.mark.timeout(60)

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=16,
                  n_experts=4, top_k=2, n_shared_experts=1, moe_hidden=32)  # fmt: skip


def _block(**kw: object) -> MoE:
    torch.manual_seed(0)
    m = MoE(LlamaConfig(**{**CFG.__dict__, **kw}))
    m.init_weights(0.5, 0.5)
    return m


def test_route_tables_stable_expert_major() -> None:
    experts = torch.tensor([[2, 0], [2, 3], [0, 2]])
    order, counts, keep = route_tables(experts, 5, None)
    assert counts.tolist() == [2, 0, 3, 1, 0]  # expert 1 and 4 receive nothing
    assert order.tolist() == [1, 4, 0, 2, 5, 3]  # expert 0: (t0,s1),(t2,s0); expert 2: t0,t1,t2; expert 3
    assert keep.all()
    one = torch.zeros(6, 2, dtype=torch.long)  # every token to expert 0
    order, counts, _ = route_tables(one, 3, None)
    assert counts.tolist() == [12, 0, 0] and order.tolist() == list(range(12))


def test_capacity_keeps_the_first_in_token_order() -> None:
    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [1, 0]])
    order, counts, keep = route_tables(experts, 3, capacity=2)
    assert counts.tolist() == [2, 2, 1]
    # expert 0 is chosen by t0, t1, t2, t3: t2 and t3 dropped; expert 1 by t0, t1, t3: t3 dropped
    assert keep.view(4, 2).tolist() == [[True, True], [True, True], [False, True], [False, False]]
    assert order.tolist() == [0, 2, 1, 3, 5]


@pytest.mark.parametrize("force", [None, 3])
def test_grouped_mm_equals_the_loop_bit_for_bit(force: int | None) -> None:
    """Forward and every gradient, with experts that get no tokens (``force``: all tokens to expert 3)."""
    results = []
    for grouped in (True, False):
        m = _block()
        m.experts.use_grouped_mm = grouped
        m.force_expert = force
        x = torch.randn(2, 8, CFG.dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
        out = m(x)
        out.square().sum().backward()
        results.append([out.detach(), x.grad, *(p.grad for p in m.parameters())])
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_moe_matches_a_dense_per_token_reference() -> None:
    m = _block(router_renorm=False)
    x = torch.randn(1, 5, CFG.dim, generator=torch.Generator().manual_seed(2))
    out = m(x)[0]
    scores = torch.softmax(x[0] @ m.router.gate.weight.T, -1)
    for t in range(5):
        top = scores[t].topk(2).indices
        want = m.shared_experts(x[0, t])
        for e in top:
            w1, w2, w3 = m.experts.w1[e], m.experts.w2[e], m.experts.w3[e]
            want = want + scores[t, e] * (w2 @ (torch.nn.functional.silu(w1 @ x[0, t]) * (w3 @ x[0, t])))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


def test_capacity_drops_and_counts() -> None:
    m = _block(capacity_factor=0.5)
    m.train()
    m.force_expert = 1
    x = torch.randn(2, 4, CFG.dim)
    out = m(x)
    # capacity ceil(0.5 * 8 * 2 / 4) = 2: tokens 0 (both slots) survive, every other routed output is dropped
    shared = m.shared_experts(x.reshape(-1, CFG.dim))
    assert not torch.allclose(out.reshape(-1, CFG.dim)[0], shared[0])
    torch.testing.assert_close(out.reshape(-1, CFG.dim)[1:], shared[1:])
    stats = after_optimizer_step(m)
    assert stats is not None and stats["dropped_fraction"] == pytest.approx(14 / 16)
    assert stats["tokens_per_expert"] == [[0, 16, 0, 0]] and stats["overload"] == 4.0


def test_bias_moves_toward_balance() -> None:
    m = _block(bias_update_rate=0.01)
    m.train()
    x = torch.randn(4, 8, CFG.dim, generator=torch.Generator().manual_seed(3)).abs()
    m(x)
    first = after_optimizer_step(m)
    assert first is not None and first["overload"] >= 1.5  # the random router is skewed
    busiest = max(range(4), key=lambda e: first["tokens_per_expert"][0][e])
    for _ in range(40):
        m(x)
        stats = after_optimizer_step(m)
    assert stats is not None and stats["overload"] <= 1.25 < first["overload"]
    assert m.expert_bias[busiest] < 0 and abs(float(m.expert_bias.sum())) < 1e-6


def test_sequence_aux_loss_is_one_when_balanced_and_trains() -> None:
    scores = torch.full((2, 4, 4), 0.25)
    experts = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]).expand(2, 4, 2)
    assert float(sequence_aux_loss(scores, experts)) == pytest.approx(1.0)
    m = _block(aux_loss_coef=0.1)
    m.train()
    m(torch.randn(2, 4, CFG.dim))
    aux = pop_aux_loss(m)
    assert aux is not None and aux.requires_grad and pop_aux_loss(m) is None
    aux.backward()
    assert m.router.gate.weight.grad is not None and m.router.gate.weight.grad.abs().sum() > 0


def test_presets() -> None:
    debug = build_llama("llama-moe-debug")
    n = sum(p.numel() for p in debug.parameters())
    assert n == count_params(PRESETS["llama-moe-debug"]) and n < 2_000_000
    assert PRESETS["llama-moe-debug"].n_experts in range(4, 9) and PRESETS["llama-moe-debug"].top_k == 2
    published = {
        "mixtral-8x7b": (46.7e9, 12.9e9),
        "qwen3-30b-a3b": (30.5e9, 3.3e9),
        "deepseek-v3": (671e9, 37e9),
    }
    for name, (total, active) in published.items():
        cfg = PRESETS[name]
        assert name in SHAPE_ONLY_PRESETS
        assert count_params(cfg) == pytest.approx(total, rel=0.02)
        assert count_params(cfg, active=True) == pytest.approx(active, rel=0.13)
    with torch.device("meta"):
        meta = build_llama("deepseek-v3")
    assert sum(p.numel() for p in meta.parameters()) == count_params(PRESETS["deepseek-v3"])
    assert type(meta.layers["2"].feed_forward).__name__ == "FeedForward"
    assert isinstance(meta.layers["3"].feed_forward, MoE)


def test_moe_every_and_refusals() -> None:
    m = build_llama(LlamaConfig(**{**CFG.__dict__, "n_layers": 4, "moe_every": 2}))
    kinds = [isinstance(m.layers[str(i)].feed_forward, MoE) for i in range(4)]
    assert kinds == [True, False, True, False]
    with pytest.raises(ConfigError, match="top_k=5 must be between 1 and model.n_experts=4"):
        LlamaConfig(n_experts=4, top_k=5)
    with pytest.raises(ConfigError, match="router_score"):
        LlamaConfig(n_experts=4, router_score="relu")
    with pytest.raises(ConfigError, match="capacity_factor"):
        LlamaConfig(n_experts=4, capacity_factor=-1.0)
    assert math.isfinite(count_params(CFG))


def test_fsdp_tp_ep_preset_and_refusals() -> None:
    """``fsdp+tp+ep``: tp 2 and ep 2 by default, ep borrowed from dp_shard x tp; refused before launch without
    sequence parallelism, with the sequence-level aux loss, and an MoE model under a TP strategy without ep is
    pointed at it."""
    from paratrain.config import StrategyConfig
    from paratrain.parallel import get_strategy
    from paratrain.spec.refusals import check

    topo = check("fsdp+tp+ep", 4, StrategyConfig(name="fsdp+tp+ep"))
    assert (topo.dp_shard, topo.tp, topo.ep) == (2, 2, 2)
    assert check("fsdp+tp+ep", 8, StrategyConfig(name="fsdp+tp+ep", ep=8)).ep == 8
    with pytest.raises(ConfigError, match="does not divide the 8 data-parallel ranks"):
        check("fsdp+tp+ep", 8, StrategyConfig(name="fsdp+tp+ep", ep=3))
    with pytest.raises(ConfigError, match="--no-sequence-parallel would give every tp rank the same tokens"):
        check("fsdp+tp+ep", 4, StrategyConfig(name="fsdp+tp+ep", sequence_parallel=False))
    with torch.device("meta"):
        model = build_llama("llama-moe-debug", {"aux_loss_coef": 0.0})
        aux = build_llama("llama-moe-debug", {"aux_loss_coef": 0.01})
    cls = get_strategy("fsdp+tp+ep")
    cls.check_model(model, 4, StrategyConfig(name="fsdp+tp+ep"))
    with pytest.raises(ConfigError, match="aux_loss_coef=0.01: the sequence-level balance loss needs whole"):
        cls.check_model(aux, 4, StrategyConfig(name="fsdp+tp+ep"))
    with pytest.raises(
        ConfigError, match=r"'fsdp\+tp' does not split MoE layers.*Use --strategy fsdp\+tp\+ep"
    ):
        get_strategy("fsdp+tp").check_model(model, 4, StrategyConfig(name="fsdp+tp"))


def test_fsdp_ep_pp_preset_and_refusals() -> None:
    """``fsdp+ep+pp``: pp 2 and ep 2 by default, ep borrowed from one stage's data-parallel ranks; refused before
    launch with the sequence-level aux loss (only the last stage computes the loss)."""
    from paratrain.config import StrategyConfig
    from paratrain.parallel import get_strategy
    from paratrain.spec.refusals import check

    topo = check("fsdp+ep+pp", 4, StrategyConfig(name="fsdp+ep+pp"))
    assert (topo.pp, topo.dp_shard, topo.tp, topo.ep) == (2, 2, 1, 2)
    assert check("fsdp+ep+pp", 8, StrategyConfig(name="fsdp+ep+pp", ep=4)).ep == 4
    with pytest.raises(ConfigError, match="--ep 8 does not divide the 4 data-parallel ranks"):
        check("fsdp+ep+pp", 8, StrategyConfig(name="fsdp+ep+pp", ep=8))
    with torch.device("meta"):
        model = build_llama("llama-moe-debug", {"aux_loss_coef": 0.0})
        aux = build_llama("llama-moe-debug", {"aux_loss_coef": 0.01})
    cls = get_strategy("fsdp+ep+pp")
    cls.check_model(model, 4, StrategyConfig(name="fsdp+ep+pp"))
    with pytest.raises(ConfigError, match=r"aux_loss_coef=0.01: under fsdp\+ep\+pp only the last stage"):
        cls.check_model(aux, 4, StrategyConfig(name="fsdp+ep+pp"))


def test_stage_stats_merge_in_layer_order() -> None:
    from paratrain.models.moe import merge_stage_stats

    late = (["layers.10.moe", "layers.3.moe"], {"tokens_per_expert": [[4, 0], [1, 3]], "overload": 2.0,
                                                "dropped_fraction": 0.5, "aux_loss": 0.25})  # fmt: skip
    early = (["layers.1.moe"], {"tokens_per_expert": [[2, 2, 4, 0]][:1], "overload": 1.5,
                                "dropped_fraction": 0.0, "aux_loss": 0.5})  # fmt: skip
    merged = merge_stage_stats([late, (["x"], None), early])
    assert merged is not None
    assert merged["tokens_per_expert"] == [[2, 2, 4, 0], [1, 3], [4, 0]]
    assert merged["overload"] == 2.0
    assert merged["dropped_fraction"] == pytest.approx(0.5 * 8 / 16)
    assert merged["aux_loss"] == pytest.approx(0.75)
    assert merge_stage_stats([(["x"], None)]) is None


def test_strategies_find_the_blocks_through_the_model_spec() -> None:
    """``expert_layers`` (what the ep strategies call) finds every MoE block of a model, inside any wrapper
    or pipeline-stage container, in module order, and nothing in a dense model."""
    from torch import nn

    from paratrain.models.spec import expert_layers

    model = build_llama(LlamaConfig(**{**CFG.__dict__, "n_layers": 3}))
    found = expert_layers(model)
    assert len(found) == 3 and all(isinstance(m, MoE) for m in found)
    assert [id(m) for m in found] == [id(m) for m in model.modules() if isinstance(m, MoE)]
    stage = nn.ModuleDict({"2": model.layers["2"]})  # a stage keeps its blocks under their own keys
    assert expert_layers(nn.Sequential(stage)) == [model.layers["2"].feed_forward]
    dense = LlamaConfig(
        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=16
    )
    assert expert_layers(build_llama(dense)) == []
    assert found[0].n_experts == CFG.n_experts and found[0].dispatcher is None
