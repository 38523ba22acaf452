"""Prompt/completion fine-tuning of an ``hf:`` model through the worker path (build_trainer, Trainer.fit).

- the first step's loss, with the whole training set as the batch, equals a masked cross-entropy computed
  by hand from ``from_pretrained``'s logits (mean over the completion tokens only);
- ``ddp`` with accumulation, and ``pp``, on 2 ranks give the losses of ``single`` (the loss is normalised by
  the global batch's predicted tokens, not per rank or micro-batch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist._reference import make_cfg, train_cases

pytestmark = [pytest.mark.dist]


def _write_records(path: Path) -> None:
    rows = []
    for i in range(40):
        a, b = i % 7, (3 * i) % 11
        rows.append({"prompt": f"add {a} and {b}: ", "completion": f"{a + b}. done"})
    rows += [{"text": "the quick brown fox jumps over the lazy dog"}] * 4
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def _case(d: Path, data: Path, *extra: str) -> list[str]:
    return [
        f"model.name=hf:{d}", "data.name=jsonl", f"data.path={data}", f"data.tokenizer=hf:{d}",
        "data.seq_len=16", "train.steps=3", "optimizer.lr=0.01", *extra,
    ]  # fmt: skip


@pytest.fixture
def records(tmp_path: Path) -> tuple[Path, Path, Any]:
    from paratrain.data import build_dataset
    from tests._hf_models import make_hf_dir

    d = make_hf_dir(tmp_path / "llama", "llama", num_hidden_layers=2)
    data = tmp_path / "records.jsonl"
    _write_records(data)
    splits = build_dataset(make_cfg(*_case(d, data)).data)
    assert (splits.train.y == -100).any() and (splits.train.y != -100).any()
    return d, data, splits


@pytest.mark.timeout(300)
def test_completion_only_loss_equals_a_hand_computed_masked_cross_entropy(
    tmp_path: Path, records: tuple[Path, Path, Any]
) -> None:
    """The first step (its loss is taken before the update) with the whole training set as the batch."""
    from tests._hf_models import reference_logits

    d, data, splits = records
    n = len(splits.train)
    first = train_cases([_case(d, data, f"train.batch_size={n}", "train.steps=1")], str(tmp_path))
    logits = reference_logits(d, splits.train.x)
    want = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), splits.train.y.flatten(), ignore_index=-100
    )
    assert first[0]["losses"][0] == pytest.approx(want.item(), rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_completion_only_loss_is_layout_free(
    dist_run: Any, tmp_path: Path, records: tuple[Path, Path, Any]
) -> None:
    """The same 3 steps under single here and ddp (accumulation 2) / pp on 2 ranks."""
    d, data, _ = records
    batch = ["train.batch_size=8"]
    single = train_cases([_case(d, data, *batch, "strategy.name=single")], str(tmp_path / "s"))[0]
    cases = [
        _case(d, data, *batch, "strategy.name=ddp", "train.grad_accum=2"),
        _case(d, data, *batch, "strategy.name=pp", "strategy.pp=2", "strategy.pp_schedule=gpipe"),
    ]
    results = dist_run(train_cases, 2, cases, str(tmp_path / "d"), timeout_s=290)[0]
    for overrides, res in zip(cases, results, strict=True):
        assert res["losses"] == pytest.approx(single["losses"], rel=1e-4), overrides[-2:]
        assert res["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-4), overrides[-2:]
