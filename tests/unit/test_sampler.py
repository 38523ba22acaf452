"""DistributedBatchSampler: disjoint rank slices that union to the single-process batch; resumable."""

from __future__ import annotations

import pytest
import torch

from paratrain.data import DistributedBatchSampler


def _single_process_batches(n: int, batch: int, seed: int, epochs: int) -> list[list[int]]:
    """Independent reference: shuffle each epoch with seed+epoch, cut consecutive full batches."""
    out = []
    for epoch in range(epochs):
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        out += [perm[i : i + batch] for i in range(0, n - batch + 1, batch)]
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_union_over_ranks_is_the_single_process_batch(world: int) -> None:
    n, batch, seed = 103, 12, 7
    ref = _single_process_batches(n, batch, seed, epochs=3)
    samplers = [DistributedBatchSampler(n, batch, r, world, seed=seed) for r in range(world)]
    for step, expected in enumerate(ref):
        parts = [s.next_batch().tolist() for s in samplers]
        assert all(len(p) == batch // world for p in parts)
        assert sum(parts, []) == expected, f"step {step}"
    assert samplers[0].epoch == 2  # advanced by itself: no set_epoch needed


def test_epochs_reshuffle_and_iter_covers_one_epoch() -> None:
    s = DistributedBatchSampler(40, 8, 0, 1, seed=0)
    first = list(s)
    second = list(s)
    assert len(first) == len(second) == 5
    assert sorted(sum(first, [])) == list(range(40))
    assert first != second


def test_resume_at_another_world_size_continues_the_global_order() -> None:
    n, batch = 64, 8
    full = DistributedBatchSampler(n, batch, 0, 1, seed=3)
    ref = [full.next_batch().tolist() for _ in range(12)]
    two = [DistributedBatchSampler(n, batch, r, 2, seed=3) for r in range(2)]
    for _ in range(5):
        for s in two:
            s.next_batch()
    state = two[0].state_dict()
    four = [DistributedBatchSampler(n, batch, r, 4, seed=3) for r in range(4)]
    for s in four:
        s.load_state_dict(state)
    for step in range(5, 12):
        assert sum((s.next_batch().tolist() for s in four), []) == ref[step]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="not divisible"):
        DistributedBatchSampler(100, 10, 0, 3)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DistributedBatchSampler(5, 8, 0, 1)
    s = DistributedBatchSampler(50, 10, 0, 1)
    with pytest.raises(ValueError, match="dataset of 40 samples"):
        s.load_state_dict(DistributedBatchSampler(40, 10, 0, 1).state_dict())
