"""Activation checkpointing really recomputes: through ``build_trainer`` (``parallelize`` ->
``apply_activation_checkpointing``), each checkpointed block runs its forward twice per training step (once in
forward, once recomputed in backward) and once without checkpointing; its activations are not kept for
backward; and the training itself (losses, parameters, BatchNorm statistics) is unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.parallel.parallelize import model_blocks
from tests.dist._reference import make_cfg

STEPS = 2
CNN_BN = ["data.name=digits", "model.name=cnn", "model.channels=4", "model.batchnorm=true", "strategy.name=single",
          "train.batch_size=16", f"train.steps={STEPS}", "optimizer.name=sgd", "optimizer.lr=0.05"]  # fmt: skip


def _train(tmp_path: Path, ac: bool) -> dict[str, Any]:
    from paratrain.runtime import init
    from paratrain.train.worker import build_trainer

    cfg = make_cfg(*CNN_BN, f"train.activation_checkpointing={str(ac).lower()}")
    trainer = build_trainer(cfg, init(device="cpu", seed=cfg.train.seed), tmp_path / f"ac-{ac}")
    blocks = model_blocks(trainer.strategy.unwrap(trainer.model))
    assert blocks is not None and len(blocks) >= 2
    wrapped = [type(b).__name__ == "CheckpointWrapper" for b in blocks]
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        inner = getattr(block, "_checkpoint_wrapped_module", block)  # the user's block inside the wrapper
        # the block's first layer: the recompute calls the block's forward directly, which skips hooks on
        # the block itself, but its layers are called as modules in both passes
        first = next(
            m for m in inner.modules() if m is not inner and len(list(m.parameters(recurse=False))) > 0
        )

        def count(*_: Any, i: int = i) -> None:
            calls[i] += 1

        first.register_forward_hook(count)
    losses = [float(trainer.train_step()) for _ in range(STEPS)]
    # bytes autograd keeps for backward during one forward (checkpointed blocks keep only their input)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    x = trainer.data.train.x[:16]
    before = list(calls)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(trainer.model(x), trainer.data.train.y[:16])
    assert [c - b for c, b in zip(calls, before, strict=True)] == [1] * len(blocks)  # forward alone: once
    del loss
    return {
        "wrapped": wrapped,
        "calls": [c - 1 for c in calls],  # the per-step count, without the saved-bytes forward above
        "losses": losses,
        "saved_bytes": sum(saved),
        "state": {
            k: v.detach().clone() for k, v in trainer.strategy.unwrap(trainer.model).state_dict().items()
        },
    }


@pytest.mark.timeout(120)
def test_activation_checkpointing_recomputes_each_block_in_backward(tmp_path: Path) -> None:
    off, on = _train(tmp_path, False), _train(tmp_path, True)
    assert not any(off["wrapped"]) and all(on["wrapped"])
    assert off["calls"] == [STEPS] * len(off["calls"])  # one forward per block per step
    assert on["calls"] == [2 * STEPS] * len(on["calls"])  # and one recomputation in each backward
    assert on["saved_bytes"] < off["saved_bytes"] / 2, (on["saved_bytes"], off["saved_bytes"])
    # recomputation changes nothing: the same losses, parameters and BatchNorm running statistics (updated
    # once per step, not again by the recomputed forward)
    assert on["losses"] == off["losses"]
    names = [k.replace("._checkpoint_wrapped_module", "") for k in on["state"]]
    assert names == list(off["state"])
    for name, t in zip(names, on["state"].values(), strict=True):
        assert torch.equal(t, off["state"][name]), name
