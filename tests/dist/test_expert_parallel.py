"""``ep``, ``fsdp+ep``, ``fsdp+tp+ep`` and ``fsdp+ep+pp`` against one process: an MoE Llama trained for 4
AdamW steps (fp32), losses and final parameters within rel 1e-4, with random routing, with every token forced
to one expert (the other experts, and whole ranks, receive nothing), with clipping on every step, and with the
pairwise all-to-all.

The reference is a plain torch loop (the model, AdamW, next-token cross-entropy over the global batch, the
expert-bias update of :func:`paratrain.models.moe.after_optimizer_step`) with no strategy. Every distributed
case goes through ``paratrain.setup`` and ``Strategy.forward_backward`` on its data-parallel rank's rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.models.llama import Llama, LlamaConfig
from paratrain.models.moe import MoE, after_optimizer_step, moe_layers

pytestmark = [pytest.mark.dist]

CFG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=64, max_seq_len=16,
                  n_experts=4, top_k=2, n_shared_experts=1, moe_hidden=32, bias_update_rate=0.01)  # fmt: skip
SEQ, BATCH, STEPS, LR = 16, 8, 4, 1e-2
EPS = 1e-6
"""AdamW's eps. At torch's 1e-8 an element whose gradient is near zero (an expert weight that a few tokens
touched: 4e-7 where the median is 5e-5) moves by a whole ``lr * sign(g)`` step, and fp32 rounding of a
different reduction order decides that sign: the layouts' updates would differ by up to ``lr`` although their
gradients agree to 1e-7 (checked in float64)."""
TOL = 1e-4


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CFG.vocab_size, (BATCH * STEPS, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.float().flatten(0, 1), y.flatten())


def _model(force: int | None) -> Llama:
    torch.manual_seed(0)
    model = Llama(CFG)
    for m in moe_layers(model):
        m.force_expert = force
    return model


def reference(force: int | None, clip: float | None) -> dict[str, Any]:
    x, y = _tokens()
    model = _model(force)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for t in range(STEPS):
        opt.zero_grad()
        loss = _lm_loss(model(x[t * BATCH : (t + 1) * BATCH]), y[t * BATCH : (t + 1) * BATCH])
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        after_optimizer_step(model)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "bias": _biases(model)}


def _biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{MoE layer name: expert bias}`` (a pipeline rank holds its stage's layers only)."""
    return {n: m.expert_bias.detach().clone() for n, m in model.named_modules() if isinstance(m, MoE)}


def _train(strategy: str, options: dict[str, Any], force: int | None, clip: float | None) -> dict[str, Any]:
    from paratrain.data import Batch
    from paratrain.parallel import setup
    from paratrain.runtime import init
    from paratrain.train.precision import Precision
    from paratrain.train.trainer import full_parameters

    model = _model(force)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    model, opt, strat = setup(model, opt, strategy=strategy, ctx=init(seed=None), **options)
    precision = Precision("fp32", torch.device("cpu"))
    x, y = _tokens()
    n, r = strat.dp_size, strat.dp_rank
    local = BATCH // n
    losses = []
    for t in range(STEPS):
        lo = t * BATCH + r * local
        opt.zero_grad(set_to_none=True)
        loss = strat.forward_backward(
            model, Batch(x[lo : lo + local], y[lo : lo + local]), _lm_loss, precision, 1
        )
        if clip is not None:
            strat.clip_grad_norm(model, clip)
        opt.step()
        after_optimizer_step(model, strat.moe_group)
        loss = loss.detach().clone()
        dist.all_reduce(loss, group=strat.dp_group)
        losses.append(float(loss) / n)
    biases: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(biases, _biases(model))
    merged: dict[str, torch.Tensor] = {}
    same = True
    for rank_biases in biases:
        for name, b in rank_biases.items():
            same = same and torch.equal(merged.setdefault(name, b), b)
    return {
        "losses": losses,
        "params": full_parameters(model),
        "bias_same": same,
        "bias": merged,
        "topology": strat.topology.degrees(),
    }


CASES: dict[int, list[tuple[str, dict[str, Any], int | None, float | None]]] = {
    2: [("ep", {}, None, None), ("ep", {"comm_algorithm": "pairwise"}, 3, 0.05)],
    4: [
        ("ep", {}, None, 0.05),
        ("fsdp+ep", {"ep": 2}, None, None),
        ("fsdp+ep", {"ep": 2}, 0, 0.05),
        ("ep", {"ep": 2, "comm_algorithm": "pairwise"}, None, None),
        ("fsdp+tp+ep", {"tp": 2, "ep": 2}, None, None),
        ("fsdp+tp+ep", {"tp": 2, "ep": 4}, None, 0.05),
        ("fsdp+tp+ep", {"tp": 2, "ep": 4, "comm_algorithm": "pairwise"}, 3, None),
        ("fsdp+ep+pp", {"pp": 2, "ep": 2}, None, 0.05),
        ("fsdp+ep+pp", {"pp": 2, "ep": 2}, 1, None),
    ],
}


def _cases(world: int) -> list[dict[str, Any]]:
    return [_train(name, options, force, clip) for name, options, force, clip in CASES[world]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world",
    [pytest.param(w, marks=pytest.mark.equivalence(*sorted({c[0] for c in CASES[w]}))) for w in (2, 4)],
)
def test_expert_parallel_matches_single_process(dist_run: Any, world: int) -> None:
    results = dist_run(_cases, world, world, timeout_s=280)[0]
    for (name, options, force, clip), res in zip(CASES[world], results, strict=True):
        ref = reference(force, clip)
        label = f"{name} {options} force={force} clip={clip} on {world} ranks ({res['topology']})"
        assert res["losses"] == pytest.approx(ref["losses"], rel=TOL, abs=1e-6), label
        assert list(res["params"]) == list(ref["params"]), label
        for pname, want in ref["params"].items():
            torch.testing.assert_close(
                res["params"][pname], want, rtol=TOL, atol=2e-5, msg=f"{label}: {pname}"
            )
        assert res["bias_same"], f"{label}: the expert bias differs between ranks"
        assert sorted(res["bias"]) == sorted(ref["bias"]), label
        for lname, want in ref["bias"].items():
            torch.testing.assert_close(res["bias"][lname], want, msg=f"{label}: {lname}")
        if force is None:
            assert any(float(b.abs().sum()) > 0 for b in ref["bias"].values())  # the bias moved


def _capacity_block() -> MoE:
    torch.manual_seed(0)
    block = MoE(LlamaConfig(**{**CFG.__dict__, "capacity_factor": 0.5}))
    block.init_weights(0.5, 0.5)
    return block


def _capacity_rank() -> dict[str, Any]:
    """One MoE block with a capacity factor, its experts over ep = 2 ranks; each rank routes its own rows."""
    from paratrain.parallel import setup
    from paratrain.runtime import init

    block = _capacity_block()
    block.train()
    wrapped = nn.Sequential(block)
    wrapped, _, strat = setup(wrapped, None, strategy="ep", ctx=init(seed=None))
    x = torch.randn(4, 8, CFG.dim, generator=torch.Generator().manual_seed(5))[2 * dist.get_rank() :][:2]
    x.requires_grad_(True)
    out = wrapped(x)
    out.square().sum().backward()
    stats = after_optimizer_step(wrapped, strat.dp_group)
    return {"out": out.detach(), "x_grad": x.grad, "stats": stats}


@pytest.mark.timeout(120)
def test_capacity_dropping_under_ep_equals_one_process_per_rank(dist_run: Any) -> None:
    """The capacity rule is applied by the rank that routes a token, to its own tokens: a single process that
    runs the same block on each rank's rows separately drops the same assignments and computes the same."""
    got = dist_run(_capacity_rank, 2, timeout_s=100)
    block = _capacity_block()
    block.train()
    x = torch.randn(4, 8, CFG.dim, generator=torch.Generator().manual_seed(5))
    dropped = assigned = 0.0
    for rank in range(2):
        xr = x[2 * rank : 2 * rank + 2].clone().requires_grad_(True)
        out = block(xr)
        out.square().sum().backward()
        torch.testing.assert_close(got[rank]["out"], out.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[rank]["x_grad"], xr.grad, rtol=1e-5, atol=1e-6)
        dropped, assigned = dropped + float(block._dropped[0]), assigned + float(block._dropped[1])
        block._dropped.zero_()
    ref_stats = after_optimizer_step(block)
    assert ref_stats is not None and dropped > 0
    for r in got:
        assert r["stats"]["dropped_fraction"] == pytest.approx(dropped / assigned)
        assert r["stats"]["tokens_per_expert"] == ref_stats["tokens_per_expert"]
