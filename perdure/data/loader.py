"""ResumableLoader: a torchdata StatefulDataLoader whose position the runner owns."""

from __future__ import annotations

import collections
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from perdure.config import MAX_ACCUM_STEPS
from perdure.data.batch import batch_length
from perdure.data.iterable import EpochAware, as_dataset, is_stateful
from perdure.data.sample_seeds import SeededBatches, SeededStream
from perdure.data.sampler import PERMUTATIONS, ResumableSampler
from perdure.errors import CheckpointError
from perdure.resilience.worker_signals import leave_signals_to_parent, preemption_signals_blocked
from perdure.safe_io import safe_name

# torchdata 0.11 calls a deprecated torch API each time an iterator is created; it is not the user's concern.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


MAX_UNTAKEN_BATCHES = MAX_ACCUM_STEPS  # a window of micro-batches at most (config.check), or an evaluation's read-ahead


class ResumableLoader:
    """One split's dataloader and the data position that goes into a checkpoint.

    Map-style datasets are read through a `ResumableSampler`: the order of an epoch is a function of (seed, epoch)
    and the position is a global sample offset, so resuming needs no fast-forward and does not depend on how the
    loader's own generator was advanced (torchdata 0.11 restores that generator one draw behind with
    `num_workers=0`). The loader's generator, which seeds the workers, is re-seeded from (seed, epoch) before each
    epoch for the same reason. Iterable datasets with state keep their position in the StatefulDataLoader's own state
    (which holds the dataset's `state_dict`); one without state restarts (`perdure.data.iterable`). A torchdata.nodes
    pipeline is read as a `NodeDataset`. With worker processes, a map-style dataset is read through `SeededBatches`:
    a worker seeds its generators before each batch from the batch's position, so random transforms draw the same
    after a resume (`perdure.data.sample_seeds`); a stream with a position is read through `SeededStream`, which
    seeds them before each sample from where it is in the worker's pass.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        shuffle: bool,
        num_workers: int = 0,
        drop_last: bool = False,
        pin_memory: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        collate_fn: Callable | None = None,
        pad: bool = True,
    ) -> None:
        dataset = as_dataset(dataset)
        self.dataset = dataset
        self.batch_size = batch_size
        self.world_size = world_size
        self.seed = seed
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self.sampler: ResumableSampler | None = None
        read = dataset
        if not isinstance(dataset, IterableDataset):
            self.sampler = ResumableSampler(
                len(dataset),  # type: ignore[arg-type]
                shuffle=shuffle,
                seed=seed,
                rank=rank,
                world_size=world_size,
                drop_last=drop_last,
                pad=pad,
                sample_seeds=num_workers > 0,
            )
            if num_workers > 0:
                read = SeededBatches(dataset)
        elif num_workers > 0 and is_stateful(dataset):
            read = SeededStream(dataset, seed, rank)
        self.loader = StatefulDataLoader(
            read,
            batch_size=batch_size,
            sampler=self.sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            pin_memory=pin_memory,
            generator=self.generator,
            collate_fn=collate_fn,
            worker_init_fn=leave_signals_to_parent if num_workers > 0 else None,  # the training process decides
        )
        self._iterable_state: dict[str, Any] | None = None
        # Samples of each batch yielded, not yet taken; bounded for a caller that reads batches and never takes them.
        self._yielded: collections.deque[int] = collections.deque(maxlen=MAX_UNTAKEN_BATCHES)
        self.restored_samples: int | None = None  # the map-style dataset's length when the restored position was saved

    @property
    def is_iterable(self) -> bool:
        return self.sampler is None

    def samples_per_epoch(self) -> int | None:
        """Samples all ranks together read in a whole epoch, or None when the dataset has no length."""
        if self.sampler is None:
            return None
        if self.loader.drop_last:
            per_rank = (self.sampler.total_size // self.world_size) // self.batch_size * self.batch_size
            return per_rank * self.world_size
        return self.sampler.total_size

    def take_samples(self, batches: int) -> int:
        """This rank's samples in the next `batches` batches the current epoch's iterator yielded (in order; each is
        taken once; at most the last `MAX_UNTAKEN_BATCHES` are kept). A map-style dataset's are counted from the
        sampler, as its batches were cut, whatever a `collate_fn` makes of them (sequences packed into one row, say); a
        stream's are its batches' leading dimension."""
        return sum(self._yielded.popleft() for _ in range(batches))

    def iter_epoch(self, epoch: int, samples_done: int = 0, limit: int | None = None) -> Iterator[Any]:
        """An iterator over epoch `epoch` that skips the `samples_done` samples all ranks together consumed and, with
        `limit`, ends after the epoch's first `limit` samples (all ranks together; map-style datasets)."""
        self.generator.manual_seed(self.seed * 1_000_003 + epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(epoch, samples_done, limit)
        elif isinstance(self.dataset, EpochAware):  # before the loader copies it into its workers
            self.dataset.set_epoch(epoch)
        if self.sampler is None and self._iterable_state is not None:
            self.loader.load_state_dict(self._iterable_state)
            self._iterable_state = None
        self._yielded.clear()
        with preemption_signals_blocked():  # workers start here: see perdure.resilience.worker_signals
            batches = iter(self.loader)
        return self._counted(batches, self._batch_sizes())

    def _batch_sizes(self) -> Iterator[int] | None:
        """The sizes of the batches the epoch just set yields this rank, as torch's batch sampler cuts its indices;
        None for a stream."""
        if self.sampler is None:
            return None
        full, rest = divmod(len(self.sampler), self.batch_size)
        return itertools.chain(
            itertools.repeat(self.batch_size, full), [rest] if rest and not self.loader.drop_last else []
        )

    def _counted(self, batches: Iterator[Any], sizes: Iterator[int] | None) -> Iterator[Any]:
        for batch in batches:
            size = next(sizes, None) if sizes is not None else None
            self._yielded.append(batch_length(batch) if size is None else size)
            yield batch

    def position(self, epoch: int, samples_done: int) -> dict[str, Any]:
        """The rank-local data position to checkpoint, for an epoch and the samples of it all ranks consumed."""
        state: dict[str, Any] = {"epoch": epoch, "offset": samples_done, "world_size": self.world_size}
        if self.sampler is not None:
            state["permutation"] = self.sampler.permutation
            state["samples"] = self.sampler.dataset_len
        elif is_stateful(self.dataset):
            state["loader"] = self.loader.state_dict()
        return state

    def restore(self, state: dict[str, Any]) -> None:
        """Take back a position saved by `position` (the runner passes epoch and batches itself). A position without
        a permutation was saved before perdure had more than one: its order was `torch.randperm`'s. One without the
        dataset's length was saved before perdure recorded it (`restored_samples` stays None)."""
        if self.sampler is not None:
            permutation = state.get("permutation", "randperm")
            if permutation not in PERMUTATIONS:
                wanted = ", ".join(PERMUTATIONS)
                raise CheckpointError(
                    f"the data position names permutation {safe_name(permutation)}, not one of {wanted}: the "
                    "checkpoint is not one perdure wrote"
                )
            samples = state.get("samples")
            if samples is not None and (type(samples) is not int or samples <= 0):
                raise CheckpointError(
                    f"the data position's dataset length {safe_name(samples)} is not a positive integer: the "
                    "checkpoint is not one perdure wrote"
                )
            self.sampler.permutation = permutation
            self.restored_samples = samples
        elif is_stateful(self.dataset) and "loader" in state:
            self._iterable_state = state["loader"]

    def length_change(self) -> tuple[int, int] | None:
        """(the dataset's length when the restored position was saved, its length now) if they differ, else None."""
        if self.sampler is None or self.restored_samples is None or self.restored_samples == self.sampler.dataset_len:
            return None
        return self.restored_samples, self.sampler.dataset_len

    def __len__(self) -> int:
        """Batches of the epoch the last `iter_epoch` began (what is left of it from where it began)."""
        return len(self.loader)

    def batch_count(self, limit: int | None = None) -> int:
        """Batches this rank reads of an epoch from its start, ended after `limit` samples (all ranks together), as
        `iter_epoch(epoch, 0, limit)` reads them; unlike `len()`, whatever the last `iter_epoch` was. Map-style only."""
        if self.sampler is None:
            raise TypeError("batch_count: an iterable dataset's batches are not known ahead")
        samples = self.sampler.rank_samples(0, limit)
        return samples // self.batch_size if self.loader.drop_last else math.ceil(samples / self.batch_size)
