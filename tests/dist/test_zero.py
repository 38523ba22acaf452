"""zero1 / zero2 / zero3 / hsdp on 2 and 4 Gloo ranks against an independent single-process reference.

Each distributed function loops over several cases inside one process group (one spawn per world size).
The reference is a plain torch loop over the *global* batch; rank r of N takes the contiguous sub-block r
of each global batch, as paratrain's sampler does, so the mean gradient is mathematically the same.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.models.mlp import MLP

D_IN, HIDDEN, LAYERS, CLASSES = 16, 24, 2, 5  # head (5, 24): uneven dim-0 chunks on 4 ranks (2, 2, 1, 0)
BATCH, STEPS = 16, 3


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH * STEPS, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (BATCH * STEPS,), generator=g)
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(D_IN, HIDDEN, LAYERS, CLASSES)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # Two groups with different options: rebinding must match parameters by name and keep each group's.
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.02}],
        lr=0.01,
    )


def _reference(clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process torch: one full global batch per step."""
    x, y = _data()
    model = _model()
    opt = _optimizer(model)
    losses = []
    for t in range(STEPS):
        xb, yb = x[t * BATCH : (t + 1) * BATCH], y[t * BATCH : (t + 1) * BATCH]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.is_initialized() and dist.get_rank() != 0:
        return {}  # cpu_offload=True gathers the full state on rank 0 only
    names = [n.removeprefix("module.") for n, _ in model.named_parameters()]  # DDP's wrapper prefix
    return {n: sd[n].float().clone() for n in names}


def _full_optim(model: nn.Module, opt: Any) -> dict[str, dict[str, torch.Tensor]]:
    """The full (unsharded) optimizer state export, keyed by parameter name, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() != 0:
        return {}
    return {
        k.removeprefix("module."): {n: v.clone() for n, v in st.items()} for k, st in osd["state"].items()
    }


def _build(strategy: str, options: dict[str, Any] | None = None) -> tuple[nn.Module, Any, Any]:
    from paratrain.parallel import setup
    from paratrain.runtime import init

    model = _model()
    return setup(model, _optimizer(model), strategy=strategy, ctx=init(seed=None), **(options or {}))


def _steps(
    model: nn.Module, opt: Any, strat: Any, steps: range, accum: int = 1, clip: float | None = None
) -> list[float]:
    """The training loop on this rank (rank r of N takes sub-block r of each global batch)."""
    x, y = _data()
    n, r = strat.dp_size, strat.dp_rank
    local = BATCH // n
    micro = local // accum
    losses = []
    for t in steps:
        lo = t * BATCH + r * local
        xb, yb = x[lo : lo + local], y[lo : lo + local]
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for k in range(accum):
            sl = slice(k * micro, (k + 1) * micro)
            with strat.no_sync(model) if k < accum - 1 else contextlib.nullcontext():
                loss = nn.functional.cross_entropy(model(xb[sl]).float(), yb[sl])
                (loss / accum).backward()
            total += loss.detach() / accum
        if clip is not None:
            strat.clip_grad_norm(model, clip)
        opt.step()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _train(
    strategy: str, options: dict[str, Any], accum: int = 1, clip: float | None = None
) -> dict[str, Any]:
    """Train with ``paratrain.setup`` on this rank; global mean losses, full params, group options."""
    model, opt, strat = _build(strategy, options)
    losses = _steps(model, opt, strat, range(STEPS), accum, clip)
    groups = [{k: v for k, v in g.items() if k in ("lr", "weight_decay")} for g in opt.param_groups]
    return {
        "losses": losses,
        "params": _full_params(model),
        "groups": groups,
        "group_sizes": [len(g["params"]) for g in opt.param_groups],
    }


# (strategy, setup options, grad_accum, clip, tolerance) per world size: every case in one process group.
CASES: dict[int, list[tuple[str, dict[str, Any], int, float | None, float]]] = {
    1: [("zero1", {}, 1, None, 1e-6), ("zero2", {}, 2, 0.5, 1e-6), ("zero3", {}, 1, None, 1e-6)],  # no comm
    2: [
        ("zero1", {}, 1, None, 1e-5),
        ("zero2", {}, 1, None, 1e-5),
        ("zero3", {}, 1, None, 1e-5),
        ("hsdp", {}, 1, None, 1e-5),  # default shard size 1: 2 replicas of an unsharded model
        ("hsdp", {"shard_size": 2}, 1, None, 1e-5),
        ("zero2", {}, 2, 0.5, 1e-5),  # accumulation (no_sync) + global-norm clipping
        ("zero3", {"shard_accumulated_grads": True}, 2, 0.5, 1e-5),  # a reduce-scatter on every micro-step
    ],
    4: [
        ("zero1", {}, 1, None, 1e-5),
        ("zero2", {}, 1, None, 1e-5),
        ("zero3", {}, 1, None, 1e-5),
        ("hsdp", {"shard_size": 2}, 1, None, 1e-5),  # 2 replicas x 2 shards
        ("zero1", {}, 2, 0.5, 1e-5),
        ("zero2", {"bucket_cap_mb": 0.002}, 1, 0.5, 1e-5),  # ~2 KB buckets: several reduce-scatters in flight
        ("zero3", {}, 2, 0.5, 1e-5),
        ("hsdp", {"shard_size": 2}, 1, 0.5, 1e-5),
        ("hsdp", {"shard_size": 2, "shard_accumulated_grads": True}, 2, None, 1e-5),
        ("zero3", {"offload": True, "shard_units": "root"}, 1, None, 1e-5),  # on CPU: the same code path
    ],
}
# bf16 (zero3's MixedPrecisionPolicy included) is held to a bf16 reference in test_precision.py: against this
# fp32 reference only a loose tolerance would pass, one that frozen weights pass too.


def _memory(names: list[str]) -> dict[str, tuple[int, int]]:
    """(largest model_state_bytes over ranks, Ψ) after one AdamW step, per strategy."""
    from paratrain.parallel import model_state_bytes, setup
    from paratrain.runtime import init

    out = {}
    for name in names:
        torch.manual_seed(0)
        model = MLP(64, 256, 3, 10)
        psi = sum(p.numel() for p in model.parameters())
        model, opt, _ = setup(
            model, torch.optim.AdamW(model.parameters()), strategy=name, ctx=init(seed=None)
        )
        nn.functional.cross_entropy(model(torch.randn(8, 64)), torch.randint(0, 10, (8,))).backward()
        opt.step()
        held = torch.tensor([model_state_bytes(model, opt)])
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        out[name] = (int(held), psi)
    return out


def _all_cases(world: int) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    out = []
    for name, options, accum, clip, _tol in CASES[world]:
        res = _train(name, options, accum, clip)
        out.append(res if dist.get_rank() == 0 else {})
    return out, _memory(["ddp", "zero1", "zero2", "zero3"])


def zero_formula(name: str, psi: int, n: int) -> float:
    """Bytes per rank of fp32 AdamW model state (ZeRO paper, section 5, with K = 8 for two fp32 moments)."""
    return {
        "ddp": 16 * psi,
        "zero1": 8 * psi + 8 * psi / n,
        "zero2": 4 * psi + 12 * psi / n,
        "zero3": 16 * psi / n,
    }[name]


@pytest.mark.dist
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "world",
    [pytest.param(w, marks=pytest.mark.equivalence(*sorted({c[0] for c in CASES[w]}))) for w in (1, 2, 4)],
)
def test_sharded_strategies_match_single_process(dist_run: Any, world: int) -> None:
    results, memory = dist_run(_all_cases, world, world, timeout_s=170)[0]
    # measured bytes are the ZeRO formulas plus exactly what they leave out: AdamW's 4-byte `step` per
    # parameter tensor (8 tensors), and at N = 4 the dim-0 padding of the 10-row head (10 rows in chunks of 3:
    # under one row of weight and bias, 257 values, at 16 bytes each, on the largest rank)
    for name, (held, psi) in memory.items():
        expected = zero_formula(name, psi, world)
        excess = held - expected
        padding = 16 * (256 + 1) if world == 4 and name != "ddp" else 0
        assert 4 * 8 <= excess <= 4 * 8 + padding, (name, world, held, expected)
    if world > 1:
        assert memory["zero3"][0] < memory["zero2"][0] < memory["zero1"][0] < memory["ddp"][0]
    refs: dict[float | None, tuple[list[float], dict[str, torch.Tensor]]] = {}
    for (name, options, accum, clip, tol), res in zip(CASES[world], results, strict=True):
        if clip not in refs:
            refs[clip] = _reference(clip)
        ref_losses, ref_params = refs[clip]
        label = f"{name} {options} accum={accum} clip={clip} on {world} ranks"
        assert res["losses"] == pytest.approx(ref_losses, rel=tol, abs=tol), label
        assert list(res["params"]) == list(ref_params), label
        for pname, ref in ref_params.items():
            torch.testing.assert_close(res["params"][pname], ref, rtol=tol, atol=tol, msg=f"{label}: {pname}")
        # rebinding kept each group's options and members (4 weights with decay, 3 biases without)
        assert res["groups"] == [{"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.02, "weight_decay": 0.0}], label
        assert res["group_sizes"] == [LAYERS + 1, LAYERS + 1], label
        assert not math.isnan(res["losses"][-1])


def _grads_after_a_first_micro_step() -> dict[str, Any]:
    """Gradients held after the first of two accumulation micro-steps, with and without
    ``shard_accumulated_grads``: the local gradient shard already reduced, or none yet (FSDP2 holds the
    unsharded accumulation inside, and reduces on the last micro-step)."""
    out: dict[str, Any] = {}
    x, y = _data()
    for shard in (False, True):
        model, _opt, strat = _build("zero3", {"shard_accumulated_grads": shard})
        with strat.no_sync(model):
            nn.functional.cross_entropy(model(x[:4]), y[:4]).backward()
        grads = [p.grad for p in model.parameters()]
        out[str(shard)] = {
            "held": sum(g is not None for g in grads),
            "local": sum(g.to_local().numel() for g in grads if g is not None),
            "params": sum(p.numel() for p in model.parameters()),
        }
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_shard_accumulated_grads_reduces_on_every_micro_step(dist_run: Any) -> None:
    res = dist_run(_grads_after_a_first_micro_step, 2, timeout_s=110)[0]
    assert res["False"]["held"] == 0  # unsharded accumulation, reduced on the last micro-step
    n = len(list(_model().parameters()))
    assert res["True"]["held"] == n  # every parameter's gradient shard, reduced already
    assert res["True"]["local"] <= res["True"]["params"] / 2 + 16 * 257  # half of each tensor (dim-0 padding)


# ---- checkpoints: DCP sharded save/load, across strategies -------------------------------------------------
def _checkpoint_roundtrip(root: str) -> dict[str, Any]:
    """Save after 2 steps, take a 3rd; then load that checkpoint into fresh runs and take the 3rd again."""
    from paratrain.checkpoint import CheckpointManager
    from paratrain.runtime import init

    ctx = init(seed=None)
    out: dict[str, Any] = {}
    for saver, loaders in (("zero3", ["zero3", "ddp", "zero1"]), ("zero1", ["zero1", "zero2", "zero3"])):
        model, opt, strat = _build(saver)
        _steps(model, opt, strat, range(2))
        saved_at = _full_params(model)
        path = CheckpointManager(f"{root}/{saver}", ctx).save(2, model, opt, {"strategy": saver})
        out[f"{saver}:saved"] = saved_at
        out[f"{saver}:optim"] = _full_optim(model, opt)
        out[f"{saver}:continued"] = (_steps(model, opt, strat, range(2, 3)), _full_params(model))
        for loader in loaders:
            model, opt, strat = _build(loader)
            CheckpointManager(f"{root}/{saver}", ctx).load(path, model, opt)
            loaded = (_full_params(model), _full_optim(model, opt))
            out[f"{saver}->{loader}"] = (loaded, _steps(model, opt, strat, range(2, 3)), _full_params(model))
    return out


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_checkpoint_save_load_across_strategies(dist_run: Any, tmp_path: Any) -> None:
    out = dist_run(_checkpoint_roundtrip, 2, str(tmp_path), timeout_s=110)[0]
    for saver, loaders in (("zero3", ["zero3", "ddp", "zero1"]), ("zero1", ["zero1", "zero2", "zero3"])):
        saved = out[f"{saver}:saved"]
        cont_losses, cont_params = out[f"{saver}:continued"]
        for loader in loaders:
            (loaded, loaded_optim), losses, params = out[f"{saver}->{loader}"]
            for k in saved:  # the full (unsharded) state is restored exactly, whatever the layout
                torch.testing.assert_close(loaded[k], saved[k], rtol=0, atol=0, msg=f"{saver}->{loader}: {k}")
            saved_optim = out[f"{saver}:optim"]
            assert set(saved_optim) == set(saved) == set(loaded_optim)
            for k, st in saved_optim.items():  # full optimizer-state export: same from every strategy
                assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
                for n, v in st.items():
                    assert v.shape == loaded_optim[k][n].shape == (saved[k].shape if n != "step" else ())
                    torch.testing.assert_close(
                        loaded_optim[k][n], v, rtol=0, atol=0, msg=f"{saver}->{loader}: {k}.{n}"
                    )
            # ... and so is the optimizer state: the next step is the uninterrupted run's next step
            assert losses == pytest.approx(cont_losses, abs=1e-6), (saver, loader)
            for k in cont_params:
                torch.testing.assert_close(
                    params[k], cont_params[k], rtol=1e-5, atol=1e-6, msg=f"{saver}->{loader}"
                )
    # a fresh optimizer would take a different 3rd step (Adam's first step is ~lr per element): the check bites
    model = _model()
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
    model.load_state_dict(out["zero3:saved"])
    x, y = _data()
    nn.functional.cross_entropy(model(x[2 * BATCH : 3 * BATCH]), y[2 * BATCH : 3 * BATCH]).backward()
    fresh.step()
    diff = max(
        (p.detach() - out["zero3:continued"][1][n]).abs().max().item() for n, p in model.named_parameters()
    )
    assert diff > 1e-4


def _zero2_frees_during_backward() -> dict[str, Any]:
    from paratrain.parallel import setup
    from paratrain.runtime import init

    ctx = init(seed=0)
    torch.manual_seed(0)
    model = MLP(16, 256, 4, 5)  # 256x256 weights (256 KiB): its own bucket at the cap below
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, _ = setup(model, opt, strategy="zero2", ctx=ctx, bucket_cap_mb=0.2)
    inner = getattr(opt, "buckets", None) and opt
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    seen: list[tuple[int, int]] = []  # per gradient hook (after zero2's): live send buffers, live full grads
    params = list(model.parameters())

    def sample(_p: torch.Tensor) -> None:
        sends = sum(b.send is not None for b in inner.buckets)
        grads = sum(p.grad is not None for p in params)
        seen.append((sends, grads))

    for step in range(2):
        hooks = [p.register_post_accumulate_grad_hook(sample) for p in params] if step else []
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        for h in hooks:
            h.remove()
    from tests.dist.test_zero2_peak import peaks

    # the step's peak against 4Ψ + 12Ψ/N + one bucket and ddp's: the default 25 MiB layout at 1/16 of the size
    return {"buckets": len(inner.buckets), "seen": seen, "peaks": peaks(512, 25 / 16, ctx)}


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_zero2_keeps_one_send_buffer_and_no_full_gradient_during_backward(dist_run: Any) -> None:
    from tests.dist.test_zero2_peak import RANKS, check_peaks

    for r in dist_run(_zero2_frees_during_backward, RANKS, timeout_s=110):
        check_peaks(r["peaks"])
        assert r["buckets"] >= 3, r["buckets"]
        assert max(s for s, _ in r["seen"]) == 1, r["seen"]  # one full-size send buffer at a time
        assert max(g for _, g in r["seen"]) == 0, r["seen"]  # each gradient freed by its own hook
