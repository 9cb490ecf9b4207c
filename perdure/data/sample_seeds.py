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

A stream (an `IterableDataset` with a position) has no sampler to hand out seeds: each worker reads its own copy. So a
worker seeds its generators before each sample from its worker seed (which follows from (seed, epoch) and the worker's
id), the rank, and the samples it yielded in this pass; the count travels in the worker's state beside the stream's
own (`SeededStream`). After a resume each worker continues its count where its restored position is, and draws what
the uninterrupted run drew there. Per sample here, since a worker's count is per sample (the ~15 us matter less beside
a stream's own reading).
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from perdure.errors import CheckpointError
from perdure.safe_io import safe_name

SEED_BITS = 62  # an epoch's base and a position each stay below 2**62, so base + position fits an int64


def epoch_seed_base(seed: int, epoch: int) -> int:
    """The seed of an epoch's position 0; position p gets base + p. A hash, so that epochs (and runs with other seeds)
    do not share seeds at nearby positions."""
    return _hashed_seed(f"perdure-sample-seed:{seed}:{epoch}")


def _hashed_seed(text: str) -> int:
    """A seed below 2**SEED_BITS from a hash of `text`."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
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


def stream_seed_base(worker_seed: int, rank: int, passes: int) -> int:
    """The seed of a worker's first sample in a pass over its stream; its n-th sample gets base + n. `worker_seed` is
    the seed torch gave the worker (the loader's base seed, which perdure draws from (seed, epoch) at each epoch, plus
    the worker's id): each epoch starts new workers from the dataset as it is in the main process, and its draws must
    not repeat the last epoch's."""
    return _hashed_seed(f"perdure-stream-seed:{worker_seed}:{rank}:{passes}")


SEEDS_KEY = "perdure_stream_seeds"  # in a worker's state, beside the stream's own under "stream"


class SeededStream(IterableDataset):
    """A stream with a position (`state_dict` / `load_state_dict`), read by worker processes: before each sample the
    worker seeds its global generators from where the sample is in the worker's pass, and the worker's state holds
    that count and pass beside the stream's own. The loader's workers only ever hold copies of it."""

    def __init__(self, dataset: IterableDataset, seed: int, rank: int) -> None:
        self.dataset, self.seed, self.rank = dataset, seed, rank
        self.passes = 0  # passes this worker's copy has finished
        self.count = 0  # samples it yielded in the pass under way

    def __iter__(self) -> Any:
        info = get_worker_info()
        base = stream_seed_base(info.seed if info is not None else self.seed, self.rank, self.passes)
        seed_global_generators(base + self.count)  # what the stream draws when it starts reading
        iterator = iter(self.dataset)
        while True:
            seed_global_generators(base + self.count)
            try:
                sample = next(iterator)
            except StopIteration:
                break
            self.count += 1
            yield sample
        self.count, self.passes = 0, self.passes + 1

    def state_dict(self) -> dict[str, Any]:
        stream = self.dataset.state_dict()  # type: ignore[attr-defined]
        return {"stream": stream, SEEDS_KEY: {"count": self.count, "passes": self.passes}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state saved by this class; or the stream's own, saved before perdure seeded workers of streams (its
        draws go on from the worker's first seed, as they did then)."""
        if not isinstance(state, dict) or SEEDS_KEY not in state:
            self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
            return
        seeds = state[SEEDS_KEY]
        if not isinstance(seeds, dict) or not all(
            type(seeds.get(key)) is int and seeds[key] >= 0 for key in ("count", "passes")
        ):
            raise CheckpointError(
                f"a data worker's stream seeds {safe_name(seeds)} are not two non-negative counts: the checkpoint is "
                "not one perdure wrote"
            )
        self.dataset.load_state_dict(state["stream"])  # type: ignore[attr-defined]
        self.count, self.passes = seeds["count"], seeds["passes"]
