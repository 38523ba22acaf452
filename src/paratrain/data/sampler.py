"""A distributed batch sampler that sets its own epoch and can save and restore its position.

The global batch of step ``t`` is the contiguous block ``perm[t*B:(t+1)*B]`` of the epoch's permutation,
and data-parallel rank ``r`` of ``W`` takes the sub-block ``[t*B + r*B/W, t*B + (r+1)*B/W)``. So:

- the union over ranks of one step's samples is exactly the batch a single process with batch ``B`` sees:
  the loss curve of any data-parallel run matches single-process training by construction;
- the position is counted in *global* batches, independent of the world size: a checkpoint saved with N
  ranks resumes with M ranks at the next unseen global batch, with no sample repeated or skipped
  (as long as the global batch size is unchanged).

The epoch advances by itself when an epoch's batches are exhausted (no ``set_epoch`` to forget), and each
epoch reshuffles with ``seed + epoch``. The incomplete last batch of an epoch is dropped, so every rank
always holds the same number of samples.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class DistributedBatchSampler:
    """Yields this rank's index list for each global batch; usable as a DataLoader ``batch_sampler``."""

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size % world_size:
            raise ValueError(
                f"global batch {global_batch_size} is not divisible by the data-parallel size {world_size}"
            )
        if num_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}: "
                "use a smaller --batch-size"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the data-parallel size {world_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.step = 0  # global batches already consumed in the current epoch
        self._perm: torch.Tensor | None = None
        self._perm_epoch = -1

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.world_size

    def _permutation(self) -> torch.Tensor:
        if self._perm is None or self._perm_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._perm = torch.randperm(self.num_samples, generator=g)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = self.epoch
        return self._perm

    def next_batch(self) -> torch.Tensor:
        """This rank's indices of the next global batch, rolling over into the next epoch when needed."""
        if self.step >= self.batches_per_epoch:
            self.epoch += 1
            self.step = 0
        perm = self._permutation()
        start = self.step * self.global_batch_size + self.rank * self.local_batch_size
        self.step += 1
        return perm[start : start + self.local_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch (a fresh epoch if the current one is finished)."""
        if self.step >= self.batches_per_epoch:
            self.epoch += 1
            self.step = 0
        epoch = self.epoch
        while self.epoch == epoch and self.step < self.batches_per_epoch:
            yield self.next_batch().tolist()

    def __len__(self) -> int:
        return self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position. Saved with another world size: fine. With another global batch size: the
        position is converted to samples consumed and rounded down to a whole batch of the new size."""
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"sampler state is for a dataset of {state['num_samples']} samples, this one has {self.num_samples}"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", True))
        self.epoch = int(state["epoch"])
        consumed = int(state["step"]) * int(state["global_batch_size"])
        self.step = consumed // self.global_batch_size
