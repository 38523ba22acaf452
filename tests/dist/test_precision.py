"""bf16 for every data-parallel strategy on 2 Gloo ranks against a one-process bf16 autocast reference
(zero3 in the default tier, the other strategies in ``slow``).

Each run trains through the real worker path (``build_trainer``, the strategy, ``Trainer.fit``) with
``--precision bf16`` (autocast), and zero3 also with FSDP2's bf16 policy (``strategy.mixed_precision=bf16``:
bf16 compute and gradient reduce-scatter, fp32 master weights). The tolerances are derived from bf16's
precision (``tests/dist/_reference.py``, :func:`bf16_tolerances`): a parameter may differ by a few units of
roundoff 2^-8 of each step's update, summed over the steps; a loss by what those differences can change
(nothing at step 0, where the parameters are the same: there an fp32 run, whose loss differs by ~1e-4,
fails). Every parameter must have moved by more than 10x its tolerance, so a run with frozen weights, or
one that drops a step, fails too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dist._reference import assert_matches_bf16, make_cfg, reference, train_cases

BASE = ["data.name=digits", "model.name=mlp", "model.hidden=16", "train.batch_size=16", "train.steps=4",
        "optimizer.name=sgd", "optimizer.lr=0.2"]  # fmt: skip
BF16 = [*BASE, "train.precision=bf16"]
CASES: dict[str, list[str]] = {
    "ddp": [*BF16, "strategy.name=ddp"],
    "dp": [*BF16, "strategy.name=dp"],
    "zero1": [*BF16, "strategy.name=zero1"],
    "zero2": [*BF16, "strategy.name=zero2"],
    "zero3": [*BF16, "strategy.name=zero3"],
    # FSDP2's MixedPrecisionPolicy alone: bf16 parameters in compute, bf16 reduce-scatter, fp32 master weights
    "zero3/mp-policy": [*BASE, "strategy.name=zero3", "strategy.mixed_precision=bf16"],
    "hsdp": [*BF16, "strategy.name=hsdp", "strategy.shard_size=1"],  # 2 replicas of 1 shard
}


# The default tier runs zero3 under both forms of bf16 (one short 2-rank run); ``slow`` the other strategies.
DEFAULT = ["zero3", "zero3/mp-policy"]


def _check(names: list[str], dist_run: Any, tmp_path: Path) -> dict[str, float]:
    results = dist_run(train_cases, 2, [CASES[n] for n in names], str(tmp_path), timeout_s=280)[0]
    ref = reference(make_cfg(*BF16))
    fp32 = reference(make_cfg(*BASE))
    worst = {}
    for name, got in zip(names, results, strict=True):
        used = assert_matches_bf16(got, ref, f"{name} bf16")
        worst[name] = max(used.values())
    # the reference is really bf16: it differs from fp32 training (so matching it is a statement about bf16)
    assert max(abs(a - b) for a, b in zip(ref["losses"], fp32["losses"], strict=True)) > 0
    assert any(not (ref["params"][k] == fp32["params"][k]).all() for k in ref["params"])
    return worst


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bf16_zero3_and_its_mixed_precision_policy_match_bf16_reference(
    dist_run: Any, tmp_path: Path
) -> None:
    _check(DEFAULT, dist_run, tmp_path)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_bf16_every_strategy_matches_bf16_reference(dist_run: Any, tmp_path: Path) -> None:
    worst = _check([n for n in CASES if n not in DEFAULT], dist_run, tmp_path)
    print("largest difference as a fraction of its tolerance:", {k: round(v, 3) for k, v in worst.items()})
