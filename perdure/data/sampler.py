"""A resumable sampler whose data position is one global sample offset."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler


class ResumableSampler(Sampler[int]):
    """Yields this rank's share of a (seed, epoch)-determined order, starting at a global sample offset.

    The order of an epoch depends only on `seed` and `epoch` (never on how many random draws happened before), so an
    epoch is shuffled identically whether or not the run was interrupted. Position is the number of samples consumed
    by all ranks together in this epoch (`offset`); rank `r` of `world_size` takes positions `offset + r`,
    `offset + r + world_size`, ... of the remaining order. A resume on another world size therefore neither skips nor
    repeats a sample. Without `drop_last` the order is padded by wrapping around so that every rank gets the same
    number of samples (as `DistributedSampler` does); `pad=False` (evaluation) gives each rank its uneven share
    instead, so no sample is counted twice.
    """

    def __init__(
        self,
        dataset_len: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        pad: bool = True,
    ) -> None:
        if dataset_len <= 0:
            raise ValueError(f"ResumableSampler needs a non-empty dataset, got length {dataset_len}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.dataset_len = dataset_len
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        self.offset = 0

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        """Select the epoch and the global offset the next iterator starts from."""
        self.epoch = epoch
        self.offset = offset

    @property
    def total_size(self) -> int:
        """Samples all ranks together consume in one epoch."""
        if self.drop_last:
            return (self.dataset_len // self.world_size) * self.world_size
        if not self.pad:
            return self.dataset_len
        return math.ceil(self.dataset_len / self.world_size) * self.world_size

    def epoch_order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=generator).tolist()
        else:
            order = list(range(self.dataset_len))
        total = self.total_size
        if total > len(order):
            order = (order * math.ceil(total / len(order)))[:total]
        return order[:total]

    def __iter__(self) -> Iterator[int]:
        order = self.epoch_order()
        return iter(order[self.offset + self.rank :: self.world_size])

    def __len__(self) -> int:
        remaining = max(self.total_size - self.offset, 0)
        return max(remaining - self.rank + self.world_size - 1, 0) // self.world_size

    def position(self) -> dict[str, Any]:
        """Where the next iterator starts; deliberately not named `state_dict` so torchdata does not manage it."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "world_size": self.world_size}
