"""A resumable sampler whose data position is one global sample offset, and whose order costs no per-sample objects."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from perdure.data.sample_seeds import epoch_seed_base

# Up to this many samples an epoch's order is `torch.randperm` (kept as one int32 tensor, 16 MiB at the limit);
# above it, a keyed bijection computed for the positions being read (`HashedPermutation`), so that an epoch start or
# a resume at any size costs neither the time nor the memory of a full permutation.
RANDPERM_LIMIT = 1 << 22
PERMUTATIONS = ("randperm", "hashed")
CHUNK = 1 << 16  # indices turned into Python ints at a time while iterating


class ResumableSampler(Sampler[int | tuple[int, int]]):
    """Yields this rank's share of a (seed, epoch)-determined order, starting at a global sample offset.

    The order of an epoch depends only on `seed` and `epoch` (never on how many random draws happened before), so an
    epoch is shuffled identically whether or not the run was interrupted. Position is the number of samples consumed
    by all ranks together in this epoch (`offset`); rank `r` of `world_size` takes positions `offset + r`,
    `offset + r + world_size`, ... of the remaining order. A resume on another world size therefore neither skips nor
    repeats a sample. Without `drop_last` the order is padded by wrapping around so that every rank gets the same
    number of samples (as `DistributedSampler` does); `pad=False` (evaluation) gives each rank its uneven share
    instead, so no sample is counted twice.

    The order is never a Python list: up to `RANDPERM_LIMIT` samples it is `torch.randperm(n)` seeded with
    `seed + epoch` (the order perdure has always used, so older checkpoints resume in the same order), held as one
    tensor per epoch; above, `permutation="hashed"` computes the order of the positions being read, a chunk at a time.
    Either way a resume at any offset only slices, and iterating creates Python ints a chunk at a time.

    With `sample_seeds` it yields `(seed, index)` pairs instead of indices: the seed of the sample at global position p
    is `epoch_seed_base(seed, epoch) + p`; a loader's workers seed their generators from a batch's first one
    (`perdure.data.sample_seeds`).
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
        permutation: str | None = None,
        sample_seeds: bool = False,
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
        self.sample_seeds = sample_seeds
        self.epoch = 0
        self.offset = 0
        self.limit: int | None = None
        self.permutation = permutation or ("randperm" if dataset_len <= RANDPERM_LIMIT else "hashed")
        if self.permutation not in PERMUTATIONS:
            raise ValueError(f"permutation {self.permutation!r}: use one of {', '.join(PERMUTATIONS)}")
        self._order: tuple[tuple[int, int], torch.Tensor] | None = None  # ((seed, epoch), randperm) of one epoch

    def set_epoch(self, epoch: int, offset: int = 0, limit: int | None = None) -> None:
        """Select the epoch and the global offset the next iterator starts from; `limit` ends the epoch after that
        many positions of the order (all ranks together), e.g. an evaluation bounded to its first samples."""
        self.epoch = epoch
        self.offset = offset
        self.limit = limit

    @property
    def total_size(self) -> int:
        """Samples all ranks together consume in one epoch."""
        return self.epoch_size(self.limit)

    def epoch_size(self, limit: int | None) -> int:
        """Samples all ranks together consume in one epoch that `limit` (if not None) ends after so many."""
        if self.drop_last:
            total = (self.dataset_len // self.world_size) * self.world_size
        elif not self.pad:
            total = self.dataset_len
        else:
            total = math.ceil(self.dataset_len / self.world_size) * self.world_size
        return total if limit is None else min(total, limit)

    def indices(self, positions: torch.Tensor) -> torch.Tensor:
        """Dataset indices at `positions` (int64, any shape) of this epoch's order; positions past the dataset's
        length wrap around (padding)."""
        positions = positions % self.dataset_len
        if not self.shuffle:
            return positions
        seed = self.seed + self.epoch
        if self.permutation == "hashed":
            return HashedPermutation(self.dataset_len, seed)(positions)
        if self._order is None or self._order[0] != (self.seed, self.epoch):
            self._order = None  # free the previous epoch's order before drawing the next
            generator = torch.Generator()
            generator.manual_seed(seed)
            dtype = torch.int32 if self.dataset_len < 2**31 else torch.int64  # same values, half the memory
            self._order = ((self.seed, self.epoch), torch.randperm(self.dataset_len, generator=generator, dtype=dtype))
        return self._order[1][positions].long()

    def __iter__(self) -> Iterator[int | tuple[int, int]]:  # `(seed, index)` pairs with `sample_seeds`
        start, stop, step = self.offset + self.rank, self.total_size, self.world_size
        base = epoch_seed_base(self.seed, self.epoch) if self.sample_seeds else None
        for low in range(start, stop, step * CHUNK):
            positions = torch.arange(low, min(low + step * CHUNK, stop), step, dtype=torch.int64)
            indices = self.indices(positions).tolist()
            if base is None:
                yield from indices
            else:
                yield from zip((positions + base).tolist(), indices)

    def __len__(self) -> int:
        return self.rank_samples(self.offset, self.limit)

    def rank_samples(self, offset: int = 0, limit: int | None = None) -> int:
        """Samples this rank reads of an epoch from global position `offset`, ended after `limit` (as `set_epoch`)."""
        remaining = max(self.epoch_size(limit) - offset, 0)
        return max(remaining - self.rank + self.world_size - 1, 0) // self.world_size

    def position(self) -> dict[str, Any]:
        """Where the next iterator starts; deliberately not named `state_dict` so torchdata does not manage it."""
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "world_size": self.world_size,
            "permutation": self.permutation,
        }


class HashedPermutation:
    """A pseudo-random permutation of `range(n)` keyed by `seed`, evaluated at any positions without building it.

    The positions' `bits` (the smallest number of bits holding `n - 1`) are split into a high and a low part, and six
    rounds alternately xor one part with a multiply-xorshift mix of the other part and a round key: each round is
    invertible, so together they are a bijection of the `2**bits` integers of `bits` bits (a Feistel network with
    unbalanced halves). Values it maps outside `range(n)` are mapped again until they land inside ("cycle walking"),
    which keeps it a bijection of `range(n)`; the domain is less than `2 * n`, so most values need one pass. All
    arithmetic stays below 2**63 in int64.
    """

    ROUNDS = 6
    MIX = (0x5BD1E995, 0x27D4EB2F)  # odd 31-bit multipliers: products of 31-bit values stay below 2**62

    def __init__(self, n: int, seed: int) -> None:
        if not 0 < n < 2**62:
            raise ValueError(f"HashedPermutation needs 0 < n < 2**62, got {n}")
        self.n = n
        bits = max((n - 1).bit_length(), 2)
        self.low_bits = bits // 2
        self.low_mask = (1 << self.low_bits) - 1
        self.high_mask = (1 << (bits - self.low_bits)) - 1
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.keys = torch.randint(0, 2**31 - 1, (self.ROUNDS,), generator=generator).tolist()

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """The permuted values of `positions` (int64 in `range(n)`)."""
        values = self._encrypt(positions.to(torch.int64))
        outside = (values >= self.n).nonzero().squeeze(1)
        while outside.numel():
            walked = self._encrypt(values[outside])
            values[outside] = walked
            outside = outside[walked >= self.n]
        return values

    def _encrypt(self, x: torch.Tensor) -> torch.Tensor:
        high, low = x >> self.low_bits, x & self.low_mask
        for round_index, key in enumerate(self.keys):
            if round_index % 2 == 0:
                high = high ^ (self._mix(low, key) & self.high_mask)
            else:
                low = low ^ (self._mix(high, key) & self.low_mask)
        return (high << self.low_bits) | low

    def _mix(self, part: torch.Tensor, key: int) -> torch.Tensor:
        x = ((part ^ key) & 0x7FFFFFFF) * self.MIX[0]
        x = x ^ (x >> 29)
        x = (x & 0x7FFFFFFF) * self.MIX[1]
        return x ^ (x >> 31)
