"""An independent single-process reference for data-parallel equivalence tests (plain torch, no Trainer).

``reference(cfg)`` trains ``cfg``'s model on one process with the *global* batch: plain BatchNorm over the
whole batch, no accumulation, clipping with ``torch.nn.utils.clip_grad_norm_``. The global batch of step t
is ``perm[t*B:(t+1)*B]`` of the epoch's seeded permutation, which is what N data-parallel ranks see
together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.config import RunConfig
from paratrain.data import build_dataset
from paratrain.models import build_model

BASE = [
    "train.log_every=1",
    "checkpoint.save_at_end=false",
    "train.progress=false",
    "train.epochs=none",
]


def make_cfg(*overrides: str) -> RunConfig:
    return RunConfig().override([*BASE, *overrides])


def reference(cfg: RunConfig) -> dict[str, Any]:
    torch.manual_seed(cfg.train.seed)
    data = build_dataset(cfg.data)
    model = build_model(cfg.model, data.input_shape, data.num_outputs)
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
    for _ in range(cfg.train.steps or 0):
        if pos + b > n:
            epoch, pos = epoch + 1, 0
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.train.seed + epoch))
        idx = perm[pos : pos + b]
        pos += b
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data.train.x[idx]), data.train.y[idx])
        loss.backward()
        if o.grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        acc = (model(data.test.x).argmax(1) == data.test.y).double().mean().item()
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "buffers": {k: v.detach().clone() for k, v in model.named_buffers()},
        "eval_accuracy": acc,
    }


def train_cases(cases: list[list[str]], run_root: str) -> list[dict[str, Any]]:
    """Run on every rank: train each config through the real worker path (features, strategy, Trainer)."""
    from paratrain.parallel import canonical_name
    from paratrain.runtime import init
    from paratrain.train.trainer import full_parameters
    from paratrain.worker import build_trainer

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
                "launched": reducer.launched if reducer is not None else None,
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
