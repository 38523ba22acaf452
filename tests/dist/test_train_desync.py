"""``paratrain train --check-desync-every K``: replicas compared by bit digests every K optimizer steps.

A replica perturbed on one rank (behind DDP's back, as a bug in user code or a flipped bit would) must stop
training at the next check, naming the step, the parameter and the rank; an unperturbed run must pass
every check. Real DDP and paratrain's dp on 3 Gloo ranks (ZeRO-1/2 re-gather every parameter from its owner after each
step, so a perturbed replica heals itself there), through the worker path (``build_trainer`` + ``fit``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist._reference import make_cfg

pytestmark = pytest.mark.dist


def _train(run_root: str, strategy: str, perturb_rank: int | None) -> str:
    from paratrain.runtime import init
    from paratrain.train.desync import DesyncError
    from paratrain.train.worker import build_trainer

    cfg = make_cfg(f"strategy.name={strategy}", "train.steps=6", "train.batch_size=48", "train.check_desync_every=2")
    ctx = init(seed=cfg.train.seed)
    trainer = build_trainer(cfg, ctx, Path(run_root) / strategy)
    if ctx.rank == perturb_rank:
        inner = trainer.strategy.unwrap(trainer.model)
        with torch.no_grad():
            next(iter(inner.parameters())).add_(1e-3)  # this replica now differs from the others
    try:
        trainer.fit()
    except DesyncError as e:
        return str(e)
    return "ok"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "dp"])
def test_perturbed_replica_is_named_at_the_next_check(dist_run: Any, tmp_path: Path, strategy: str) -> None:
    clean = dist_run(_train, 3, str(tmp_path / "clean"), strategy, None, timeout_s=200)
    assert clean == ["ok"] * 3
    got = dist_run(_train, 3, str(tmp_path / "bad"), strategy, 1, timeout_s=200)
    for msg in got:
        assert msg.startswith("desync at step 2"), msg
        assert "differs on rank 1" in msg and "ranks 0,2 agree" in msg, msg
