"""Sharded checkpoints across strategies and world sizes (DCP save/load through ``CheckpointManager``).

1. hsdp (2 replicas x 2 shards, 4 ranks): save after 2 steps; loading it into hsdp resumes *exactly* (the
   next step is bit-identical to the uninterrupted run's), and it cross-loads into zero3 and ddp (the full
   state restored exactly, the next step equal within float tolerance).
2. zero2 at 4 ranks -> zero1 at 3 ranks -> one process: each load restores the full parameters and the full
   AdamW state exactly, and the next step equals the run that saved it, within float tolerance.

The global batch of 24 divides over 1, 2, 3 and 4 ranks; rank r of N takes the contiguous sub-block r.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.models.mlp import MLP

D_IN, HIDDEN, CLASSES, BATCH, STEPS = 12, 16, 5, 24, 4


pytestmark = pytest.mark.slow


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(BATCH * STEPS, D_IN, generator=g), torch.randint(
        0, CLASSES, (BATCH * STEPS,), generator=g
    )


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(D_IN, HIDDEN, 2, CLASSES)


def _build(strategy: str, **options: Any) -> tuple[nn.Module, Any, Any]:
    from paratrain.parallel import setup
    from paratrain.runtime import init

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return setup(model, opt, strategy=strategy, ctx=init(seed=None), **options)


def _step(model: nn.Module, opt: Any, t: int, rank: int, world: int) -> float:
    """Global step ``t`` on this rank; returns the global mean loss."""
    x, y = _data()
    local = BATCH // world
    lo = t * BATCH + rank * local
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x[lo : lo + local]).float(), y[lo : lo + local])
    loss.backward()
    opt.step()
    total = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= world
    return float(total)


def _full_state(
    model: nn.Module, opt: Any
) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Full (unsharded) parameters and AdamW state by parameter name (on rank 0; empty elsewhere)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=dist.is_initialized())
    sd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, opt, options=options)
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}, {}
    params = {k.removeprefix("module."): v.float().clone() for k, v in sd.items()}
    optim = {
        k.removeprefix("module."): {n: v.clone() for n, v in st.items()} for k, st in osd["state"].items()
    }
    return params, optim


def _save_and_continue(root: str, name: str, strategy: str, **options: Any) -> dict[str, Any]:
    """Train 2 steps, save at step 2, take step 3: the uninterrupted run to compare loads with."""
    from paratrain.checkpoint import CheckpointManager
    from paratrain.runtime import init

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, _ = _build(strategy, **options)
    for t in range(2):
        _step(model, opt, t, rank, world)
    path = CheckpointManager(f"{root}/{name}", init(seed=None)).save(2, model, opt, {"strategy": strategy})
    saved = _full_state(model, opt)
    loss = _step(model, opt, 2, rank, world)
    return {"path": str(path), "saved": saved, "next_loss": loss, "next_params": _full_state(model, opt)[0]}


def _load_and_step(path: str, strategy: str, t: int, **options: Any) -> dict[str, Any]:
    from paratrain.checkpoint import CheckpointManager
    from paratrain.runtime import init

    model, opt, _ = _build(strategy, **options)
    CheckpointManager(Path(path).parent, init(seed=None)).load(path, model, opt)
    loaded = _full_state(model, opt)
    loss = _step(model, opt, t, dist.get_rank(), dist.get_world_size())
    return {
        "loaded": loaded,
        "next_loss": loss,
        "next_params": _full_state(model, opt)[0],
        "model": model,
        "opt": opt,
    }


def _at_four(root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"hsdp": _save_and_continue(root, "hsdp", "hsdp", shard_size=2)}
    for loader, options in (("hsdp", {"shard_size": 2}), ("zero3", {}), ("ddp", {})):
        res = _load_and_step(out["hsdp"]["path"], loader, 2, **options)
        out[f"hsdp->{loader}"] = {k: v for k, v in res.items() if k not in ("model", "opt")}
    out["zero2"] = _save_and_continue(root, "zero2", "zero2")
    return out if dist.get_rank() == 0 else {}


def _at_three(zero2_path: str, root: str) -> dict[str, Any]:
    """Load zero2@4's step-2 checkpoint into zero1@3, take step 3, save at step 3, take step 4."""
    from paratrain.checkpoint import CheckpointManager
    from paratrain.runtime import init

    res = _load_and_step(zero2_path, "zero1", 2)
    model, opt = res.pop("model"), res.pop("opt")
    path = CheckpointManager(f"{root}/zero1", init(seed=None)).save(3, model, opt, {"strategy": "zero1"})
    res["path"], res["saved"] = str(path), _full_state(model, opt)
    res["after_loss"] = _step(model, opt, 3, dist.get_rank(), dist.get_world_size())
    res["after_params"] = _full_state(model, opt)[0]
    return res if dist.get_rank() == 0 else {}


def _assert_state_equal(got: Any, want: Any, what: str) -> None:
    (params, optim), (want_params, want_optim) = got, want
    assert list(params) == list(want_params) and set(optim) == set(want_optim) == set(want_params), what
    for k, v in want_params.items():
        torch.testing.assert_close(params[k], v, rtol=0, atol=0, msg=f"{what}: {k}")
    for k, st in want_optim.items():
        assert set(optim[k]) == set(st) == {"step", "exp_avg", "exp_avg_sq"}, what
        for n, v in st.items():
            torch.testing.assert_close(optim[k][n], v, rtol=0, atol=0, msg=f"{what}: {k}.{n}")


def _assert_close_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


@pytest.mark.dist
@pytest.mark.timeout(420)
def test_sharded_checkpoints_across_strategies_and_world_sizes(dist_run: Any, tmp_path: Path) -> None:
    four = dist_run(_at_four, 4, str(tmp_path), timeout_s=200)[0]
    hsdp = four["hsdp"]
    for loader in ("hsdp", "zero3", "ddp"):
        got = four[f"hsdp->{loader}"]
        _assert_state_equal(got["loaded"], hsdp["saved"], f"hsdp -> {loader}")
        if loader == "hsdp":  # resume on the same layout: bit for bit the uninterrupted run
            assert got["next_loss"] == hsdp["next_loss"]
            for k, v in hsdp["next_params"].items():
                assert torch.equal(got["next_params"][k], v), f"hsdp -> hsdp, next step: {k}"
        else:
            assert got["next_loss"] == pytest.approx(hsdp["next_loss"], abs=1e-6), loader
            _assert_close_params(got["next_params"], hsdp["next_params"], f"hsdp -> {loader}, next step")

    three = dist_run(_at_three, 3, four["zero2"]["path"], str(tmp_path), timeout_s=150)[0]
    _assert_state_equal(three["loaded"], four["zero2"]["saved"], "zero2@4 -> zero1@3")
    assert three["next_loss"] == pytest.approx(four["zero2"]["next_loss"], abs=1e-6)
    _assert_close_params(three["next_params"], four["zero2"]["next_params"], "zero2@4 -> zero1@3, next step")

    # one process, no process group: zero1@3's step-3 checkpoint into a plain model and AdamW
    from paratrain.checkpoint import CheckpointManager
    from paratrain.runtime import init

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    CheckpointManager(tmp_path / "zero1", init(device="cpu", seed=None)).load(three["path"], model, opt)
    _assert_state_equal(_full_state(model, opt), three["saved"], "zero1@3 -> single")
    loss = _step(model, opt, 3, 0, 1)
    assert loss == pytest.approx(three["after_loss"], abs=1e-6)
    _assert_close_params(_full_state(model, opt)[0], three["after_params"], "zero1@3 -> single, next step")
    # the check bites: a fresh optimizer (state not loaded) takes a different step from the same parameters
    fresh = _model()
    fresh.load_state_dict(three["saved"][0])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    _step(fresh, fresh_opt, 3, 0, 1)
    diff = max(
        (p.detach() - three["after_params"][n]).abs().max().item() for n, p in fresh.named_parameters()
    )
    assert diff > 1e-4
