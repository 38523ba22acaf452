"""An independent single-process reference for data-parallel equivalence tests (plain torch, no Trainer).

``reference(cfg)`` trains ``cfg``'s model on one process with the *global* batch: plain BatchNorm over the
whole batch, no accumulation, clipping with ``torch.nn.utils.clip_grad_norm_``. The global batch of step t
is ``perm[t*B:(t+1)*B]`` of the epoch's seeded permutation, which is what N data-parallel ranks see
together.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.config import RunConfig
from paratrain.data import build_dataset
from paratrain.models import build_model

BASE = [
    "train.log_every=1",
    "train.eval_batches=0",  # the whole test split: the references evaluate all of it
    "checkpoint.save_at_end=false",
    "train.progress=false",
    "train.epochs=none",
]


def make_cfg(*overrides: str) -> RunConfig:
    return RunConfig().override([*BASE, *overrides])


def reference(cfg: RunConfig) -> dict[str, Any]:
    """``train.precision=bf16``: forward (and evaluation) under ``torch.autocast(cpu, bfloat16)``, as the
    Trainer runs it; the loss is taken in fp32 from the (bf16) logits."""
    torch.manual_seed(cfg.train.seed)
    data = build_dataset(cfg.data)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    initial = {k: v.detach().clone() for k, v in model.named_parameters()}
    autocast = (
        (lambda: torch.autocast(device_type="cpu", dtype=torch.bfloat16))
        if cfg.train.precision == "bf16"
        else contextlib.nullcontext
    )
    o = cfg.optimizer
    if o.name == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
    n, b = len(data.train), cfg.train.batch_size
    losses: list[float] = []
    epoch, pos = 0, 0
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.train.seed))
    model.train()
    updates: list[dict[str, float]] = []  # per step: the largest |change| of each parameter tensor
    grad_l1: list[dict[str, float]] = []  # per step: the L1 norm of each parameter's gradient
    for _ in range(cfg.train.steps or 0):
        if pos + b > n:
            epoch, pos = epoch + 1, 0
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.train.seed + epoch))
        idx = perm[pos : pos + b]
        pos += b
        opt.zero_grad()
        with autocast():
            out = model(data.train.x[idx])
        loss = nn.functional.cross_entropy(out.float(), data.train.y[idx])
        loss.backward()
        if o.grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        grad_l1.append(
            {k: float(v.grad.abs().sum()) for k, v in model.named_parameters() if v.grad is not None}
        )
        opt.step()
        updates.append({k: (v.detach() - before[k]).abs().max().item() for k, v in model.named_parameters()})
        losses.append(loss.item())
    model.eval()
    with torch.no_grad(), autocast():
        logits = model(data.test.x).float()
    acc = (logits.argmax(1) == data.test.y).double().mean().item()
    per_sample = nn.functional.cross_entropy(logits, data.test.y, reduction="none").double()
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "eval_accuracy": acc,
        "eval_loss": per_sample.mean().item(),
        "eval_correct_per_sample": (logits.argmax(1) == data.test.y).double(),
        "eval_loss_per_sample": per_sample,
        "initial_params": initial,
        "updates": updates,
        "grad_l1": grad_l1,
    }


def train_cases(cases: list[list[str]], run_root: str) -> list[dict[str, Any]]:
    """Run on every rank: train each config through the real worker path (features, strategy, Trainer)."""
    from paratrain.parallel import canonical_name
    from paratrain.runtime import init
    from paratrain.train.trainer import full_parameters
    from paratrain.train.worker import build_trainer

    out = []
    for i, overrides in enumerate(cases):
        cfg = make_cfg(*overrides)
        ctx = init(seed=cfg.train.seed)
        trainer = build_trainer(cfg, ctx, Path(run_root) / f"case{i}")
        res = trainer.fit()
        inner = trainer.strategy.unwrap(trainer.model)
        reducer = getattr(trainer.strategy, "reducer", None)
        out.append(
            {
                "losses": res.losses,
                "params": full_parameters(trainer.model),
                "buffers": {canonical_name(k): v.detach().clone() for k, v in inner.named_buffers()},
                "eval_accuracy": res.eval_accuracy,
                "eval_loss": res.eval_loss,
                "launched": reducer.launched if reducer is not None else None,
                "algorithm": reducer.algorithm if reducer is not None else None,
                "num_buckets": len(reducer.buckets) if reducer is not None else None,
                "local_params": {canonical_name(k): v.detach().clone() for k, v in inner.named_parameters()},
            }
        )
    return out


def assert_matches(got: dict[str, Any], ref: dict[str, Any], what: str, atol: float = 2e-5, rtol: float = 1e-4) -> None:
    assert len(got["losses"]) == len(ref["losses"]), what
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
        assert abs(a - b) <= atol + rtol * abs(b), f"{what}: loss of step {step}: {a} vs reference {b}"
    params = got["params"]
    assert params is not None and list(params) == list(ref["params"]), f"{what}: parameter names differ"
    for name, t in ref["params"].items():
        assert torch.allclose(params[name], t, atol=atol, rtol=rtol), (
            f"{what}: parameter {name} differs by {(params[name] - t).abs().max().item():.3g}"
        )


# ---- bf16 ---------------------------------------------------------------------------------------------
BF16_U = 2.0**-8
"""bf16's unit roundoff: 8 significant bits (7 stored); rounding to bf16 moves a value by <= 2^-8 of it."""


def bf16_tolerances(ref: dict[str, Any], ulps: float = 4.0) -> tuple[list[float], dict[str, float]]:
    """How far a data-parallel bf16 run may be from the one-process bf16 reference (``reference(cfg)`` with
    ``train.precision=bf16``): ``([loss tolerance per step], {parameter: tolerance at the end})``.

    Derivation. The forward of a sample is the same computation on one rank or on N (a row of a bf16 GEMM
    accumulates in fp32 and is rounded to bf16 once, whatever the batch). What differs is where gradients
    are rounded: one process rounds each weight gradient, a sum over the global batch, to bf16 once; N ranks
    each round their partial sum (<= u of it, u = 2^-8, bf16's unit roundoff), then add the partials (in
    fp32, or in bf16 with ``strategy.mixed_precision=bf16``: one more rounding). So a step's gradient, and
    with SGD its update ``lr * g``, differs by a few u of its size; over the steps these add up:
    ``|p_dist - p_ref| <= ulps * u * sum_s max|delta p_s|`` per tensor, ``ulps = 4`` (two roundings of
    partial sums, one of the bf16 reduction, one of slack for how a step's parameter difference changes the
    next step's gradient, second order over a few steps).
    The loss of step t sees the parameters before step t, which differ by at most that bound summed over
    the steps before t (none at step 0). To first order the loss moves by ``sum_k |g_k|_1 * |delta p_k|_inf``;
    the bf16 rounding of the logits can turn a small change of a logit into one ulp, at most as much again:
    ``2 * sum_k |g_k|_1 * tol_k(t)``, plus fp32 rounding of the mean (1e-6 relative).
    """
    names = list(ref["params"])
    running = dict.fromkeys(names, 0.0)
    loss_tols = []
    for step, loss in enumerate(ref["losses"]):
        first_order = sum(ref["grad_l1"][step][k] * ulps * BF16_U * running[k] for k in names)
        loss_tols.append(2 * first_order + 1e-6 * (1.0 + abs(loss)))
        for k in names:
            running[k] += ref["updates"][step][k]
    return loss_tols, {k: ulps * BF16_U * running[k] + 1e-7 for k in names}


def assert_matches_bf16(got: dict[str, Any], ref: dict[str, Any], what: str) -> dict[str, float]:
    """``got`` (a bf16 run) against the bf16 reference within :func:`bf16_tolerances`, and the parameters
    moved by more than 10x their tolerance (frozen weights would pass a loose comparison). Returns each
    loss's and parameter's difference as a fraction of its tolerance."""
    loss_tols, tols = bf16_tolerances(ref)
    used = {}
    for step, (a, b, tol) in enumerate(zip(got["losses"], ref["losses"], loss_tols, strict=True)):
        assert abs(a - b) <= tol, (
            f"{what}: loss of step {step}: {a} vs bf16 reference {b} (tolerance {tol:.3g})"
        )
        used[f"loss {step}"] = abs(a - b) / tol
    params = got["params"]
    assert params is not None and list(params) == list(ref["params"]), f"{what}: parameter names differ"
    for name, t in ref["params"].items():
        diff = (params[name].float() - t).abs().max().item()
        moved = (t - ref["initial_params"][name]).abs().max().item()
        assert diff <= tols[name], f"{what}: {name} differs by {diff:.3g} > tolerance {tols[name]:.3g}"
        assert moved > 10 * tols[name], (
            f"{what}: {name} moved {moved:.3g}, not > 10 x tolerance {tols[name]:.3g}"
        )
        used[name] = diff / tols[name]
    return used


def single_process_eval(
    cfg: RunConfig, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One process evaluates the given state (parameters, and BatchNorm buffers if any) on the whole test
    split: (correct, cross-entropy) per sample, float64. What ``Trainer.evaluate`` must reproduce exactly."""
    data = build_dataset(cfg.data)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
    model.load_state_dict({**params, **(buffers or {})}, strict=True)
    model.eval()
    with torch.no_grad():
        logits = model(data.test.x).float()
    correct = (logits.argmax(1) == data.test.y).double()
    return correct, nn.functional.cross_entropy(logits, data.test.y, reduction="none").double()
