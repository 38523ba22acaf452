"""ddp on N Gloo ranks follows the same loss curve and ends at the same parameters as one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paratrain.config import RunConfig
from paratrain.runtime import init
from paratrain.train.trainer import full_parameters
from paratrain.train.worker import train
from tests.dist._reference import reference

STEPS = 12
OVERRIDES = [
    "model.name=mlp",
    "model.hidden=32",
    f"train.steps={STEPS}",
    "train.batch_size=32",
    "train.log_every=1",
    "optimizer.lr=0.01",
    "checkpoint.save_at_end=false",
    "train.progress=false",
]


def _cfg(strategy: str, *extra: str) -> RunConfig:
    return RunConfig().override([*OVERRIDES, f"strategy.name={strategy}", *extra])


def _reference(cfg: RunConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain single-process loop of tests/dist/_reference.py (independent of paratrain's Trainer)."""
    ref = reference(cfg)
    return ref["losses"], ref["params"]


def _run_rank_params(cfg_json: str, run_dir: str) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    from paratrain.data import build_dataset as bd
    from paratrain.models import build_model as bm
    from paratrain.parallel import get_strategy
    from paratrain.train.trainer import Trainer, build_optimizer

    cfg = RunConfig.from_json(cfg_json)
    ctx = init(device="cpu", seed=cfg.train.seed)
    data = bd(cfg.data)
    model = bm(cfg.model, data.input_shape, data.num_outputs)
    strategy = get_strategy(cfg.strategy.name)(ctx, cfg.strategy)
    optimizer = build_optimizer(model, cfg)
    model, optimizer = strategy.wrap(model, optimizer)
    result = Trainer(cfg, ctx, model, optimizer, strategy, data, 0, run_dir).fit()
    return result.losses, full_parameters(model)


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.equivalence("ddp")
@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_single_process_reference(dist_run, tmp_path: Path, world: int) -> None:
    cfg = _cfg("ddp")
    ref_losses, ref_params = _reference(cfg)
    results = dist_run(_run_rank_params, world, cfg.to_json(), str(tmp_path))
    losses, params = results[0]
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=1e-5)
    assert params is not None and list(params) == list(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-5, msg=f"parameter {name}")
    # every rank reports the same global-mean losses
    for other, _ in results[1:]:
        assert other == losses


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.equivalence("single")
def test_single_strategy_matches_reference(tmp_path: Path) -> None:
    cfg = _cfg("single")
    ref_losses, ref_params = _reference(cfg)
    ctx = init(device="cpu", seed=cfg.train.seed)
    result = train(cfg, ctx, tmp_path)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert result.world_size == 1 and result.param_sha256 and len(result.param_sha256) == 64
    # the same path once more, keeping the model, to compare its parameters too
    losses, params = _run_rank_params(cfg.to_json(), str(tmp_path / "again"))
    assert losses == result.losses and params is not None and list(params) == list(ref_params)
    for name, p in ref_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=f"parameter {name}")
