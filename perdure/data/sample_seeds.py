"""Seeds for dataloader workers: a random transform in a worker draws the same numbers after a resume.

A worker's generators are seeded once, when the worker starts, and a worker reads whichever batches it is handed. A
resume starts new workers in the middle of an epoch, so a transform that draws from the global generators
(`torch.rand`, `random`, numpy; torchvision's random crops and flips) would draw other numbers after a resume than
the uninterrupted run did. With workers, the sampler therefore hands each sample a seed derived from (seed, epoch, the
sample's position in the epoch's order), and the worker seeds torch's, Python's and numpy's global generators from the
first sample's seed just before it reads a batch. What a batch's transforms draw then depends only on where the batch
is in the run: not on a resume (which always starts at a batch), nor on which worker reads it or how many there are.

Once per batch, not per sample: seeding the three generators costs ~15 us, which per sample would triple what a
worker spends on a light sample (a window of tokens). A resume on the same number of ranks and batch size reads the
same batches, so per batch is enough for it to be exact.

In the main process (`num_workers = 0`) nothing is reseeded: a transform draws from the run's own generators, which
the checkpoint holds.
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch
from torch.utils.data import Dataset

SEED_BITS = 62  # an epoch's base and a position each stay below 2**62, so base + position fits an int64


def epoch_seed_base(seed: int, epoch: int) -> int:
    """The seed of an epoch's position 0; position p gets base + p. A hash, so that epochs (and runs with other seeds)
    do not share seeds at nearby positions."""
    digest = hashlib.blake2b(f"perdure-sample-seed:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - SEED_BITS)


def seed_global_generators(seed: int) -> None:
    """Seed torch's CPU generator, Python's `random` and, where imported, numpy's global generator from one seed."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed([seed & 0xFFFFFFFF, seed >> 32])


class SeededBatches(Dataset):
    """A map-style dataset read with `(seed, index)` keys, a batch at a time: seeds the worker's generators from the
    batch's first seed, then reads the batch as torch would (the dataset's own `__getitems__` where it has one). Only a
    loader with worker processes reads through it."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        seed, index = key
        seed_global_generators(seed)
        return self.dataset[index]

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        seed_global_generators(keys[0][0])
        indices = [index for _, index in keys]
        read_batch = getattr(self.dataset, "__getitems__", None)  # torch's own test for a dataset that reads batches
        if read_batch:
            return read_batch(indices)
        return [self.dataset[index] for index in indices]
