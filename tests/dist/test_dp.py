"""``ddp`` and the from-scratch ``dp`` (every comm algorithm) against an independent single-process reference
with the same global batch, on 2 and 4 Gloo ranks; accumulation; unused parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import COMM_ALGORITHMS
from tests.dist._reference import assert_matches, make_cfg, reference, train_cases

MLP = [
    "model.name=mlp", "model.hidden=32", "data.name=synthetic-classification", "data.num_samples=512",
    "train.steps=4", "train.batch_size=16", "optimizer.name=sgd", "optimizer.lr=0.05",
    "strategy.bucket_cap_mb=0.002",  # ~2 KB buckets: the 5 KB model spreads over several buckets
]  # fmt: skip
# a missing algorithm fails the test, it never silently drops out; pairwise is an all-to-all, not a reduction
ALGORITHMS = [a for a in COMM_ALGORITHMS if a != "pairwise"]


def _cases(world_size: int) -> dict[str, list[str]]:
    cases = {"ddp": [*MLP, "strategy.name=ddp"]}
    for alg in ALGORITHMS:
        cases[f"dp/{alg}"] = [*MLP, "strategy.name=dp", f"strategy.comm_algorithm={alg}"]
    # Accumulating K micro-batches of B/K equals one batch of B (per rank: 16/W samples in K pieces).
    cases["ddp/accum2"] = [*MLP, "strategy.name=ddp", "train.grad_accum=2"]
    cases["dp/accum2"] = [*MLP, "strategy.name=dp", f"strategy.comm_algorithm={ALGORITHMS[-1]}", "train.grad_accum=2"]
    if world_size == 2:
        cases["dp/native/accum4"] = [*MLP, "strategy.name=dp", "train.grad_accum=4"]
    return cases


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.equivalence(*sorted({name.split("/")[0] for name in _cases(2)}))
@pytest.mark.parametrize("world_size", [2, 4])
def test_strategies_match_single_process(dist_run: Any, tmp_path: Path, world_size: int) -> None:
    cases = _cases(world_size)
    results = dist_run(train_cases, world_size, list(cases.values()), str(tmp_path), timeout_s=220)
    rank0 = results[0]
    for (name, overrides), got in zip(cases.items(), rank0, strict=True):
        ref = reference(make_cfg(*overrides, "train.grad_accum=1"))
        assert_matches(got, ref, f"{name} x{world_size}")
        if name.startswith("dp"):
            k = 4 if "accum4" in name else 2 if "accum2" in name else 1
            assert got["num_buckets"] > 1
            # communication only on the last micro-step: one launch per bucket per optimizer step
            assert got["launched"] == got["num_buckets"] * 4, f"{name}: {got['launched']} launches (K={k})"
    for r in range(1, world_size):  # every replica holds the same parameters
        for got, got0 in zip(results[r], rank0, strict=True):
            for k, v in got["local_params"].items():
                assert torch.equal(v, got0["local_params"][k])


# ---- parameters without a gradient --------------------------------------------------------------------------
class _Branchy(nn.Module):
    """``extra`` is used only on rank 0; ``dead`` on no rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.dead = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if dist.get_rank() == 0:
            h = h + self.extra(h)
        return self.b(h)


def _unused_dp() -> dict[str, Any]:
    from paratrain.parallel import setup
    from paratrain.runtime import init

    ctx = init(seed=0)
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, strat = setup(model, opt, strategy="dp", ctx=ctx, bucket_cap_mb=0.0001)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    local = {}
    with strat.no_sync(model):  # local gradients only, to know what each rank contributed
        model(x).sum().backward()
    local = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    local_all = [None] * dist.get_world_size()
    dist.all_gather_object(local_all, local)
    opt.zero_grad(set_to_none=True)
    model(x).sum().backward()
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    opt.step()
    return {"grads": grads, "local": local_all, "params": [p.detach().clone() for p in model.parameters()]}


def _unused_ddp(find_unused: bool) -> str:
    import warnings

    from paratrain.parallel import setup
    from paratrain.runtime import init

    ctx = init(seed=0)
    model = _Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = setup(model, opt, strategy="ddp", ctx=ctx, find_unused_parameters=find_unused)
    x = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(2):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
        except RuntimeError as e:
            return f"error: {e}"
    return "warning: " + " | ".join(str(w.message) for w in caught if "no gradient" in str(w.message))


def _unused_all() -> dict[str, Any]:
    return {"dp": _unused_dp(), "ddp_find": _unused_ddp(True), "ddp_nofind": _unused_ddp(False)}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_unused_parameters(dist_run: Any) -> None:
    res = dist_run(_unused_all, 2, timeout_s=100)
    dp0, dp1 = res[0]["dp"], res[1]["dp"]
    # dp: a parameter used on some ranks gets the average of their contributions (zeros elsewhere) ...
    for name in ("a.weight", "extra.weight", "b.bias"):
        contributions = [loc[name] if loc[name] is not None else 0.0 for loc in dp0["local"]]
        expect = sum(contributions) / 2
        assert torch.allclose(dp0["grads"][name], expect, atol=1e-6), name
        assert torch.equal(dp0["grads"][name], dp1["grads"][name]), name
    # ... and one used on no rank keeps grad=None, as it would in one process
    assert dp0["grads"]["dead.weight"] is None and dp1["grads"]["dead.weight"] is None
    for a, b in zip(dp0["params"], dp1["params"], strict=True):
        assert torch.equal(a, b)
    # ddp with find_unused_parameters: it works and warns, naming the unused parameters
    assert res[0]["ddp_find"].startswith("warning: ") and "dead.weight" in res[0]["ddp_find"]
    assert "extra.weight" in res[1]["ddp_find"]  # unused on rank 1 only
    # ddp without it: one clear error naming the parameters and the fix
    msg = res[1]["ddp_nofind"]
    assert msg.startswith("error: ") and "extra.weight" in msg and "find_unused_parameters=true" in msg
