"""Seeds in dataloader workers: what a random transform draws for a batch depends only on where the batch is in the
run (seed, epoch, position), never on a resume, the worker that reads it, or the number of workers."""

from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch.utils.data import Dataset

from perdure.data.loader import ResumableLoader

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:This DataLoader will create")]


class Augmented(Dataset):
    """Sample i is (i, a draw from torch's, Python's and numpy's global generators), as a random transform draws."""

    def __len__(self):
        return 29

    def __getitem__(self, index):
        return torch.tensor([float(index), float(torch.rand(())), random.random(), float(numpy.random.rand())])


class BatchReading(Augmented):
    """A dataset that reads a batch at once (`__getitems__`); the first value of each sample is the batch's size."""

    def __getitems__(self, indices):
        return [torch.cat([self[index][:1], torch.tensor([float(len(indices))]), torch.rand(2)]) for index in indices]


def drawn(num_workers, *, epoch=1, offset=0, dataset=None):
    """{sample index: its draws} of a read of an epoch from a global offset (batches of 3; 29 samples)."""
    loader = ResumableLoader(dataset or Augmented(), batch_size=3, shuffle=True, num_workers=num_workers, seed=7)
    rows = torch.cat(list(loader.iter_epoch(epoch, offset)))
    return {int(row[0]): row[1:].tolist() for row in rows}


def test_a_resumed_epoch_draws_what_the_uninterrupted_one_drew_on_any_number_of_workers():
    whole = drawn(2)
    assert len(whole) == 29 and len({tuple(draws) for draws in whole.values()}) == 29, "every sample draws anew"
    resumed = drawn(2, offset=12)  # new workers, started in the middle of the epoch
    assert len(resumed) == 17 and all(whole[index] == draws for index, draws in resumed.items())
    assert drawn(1) == whole and drawn(3, offset=12) == resumed


def test_another_epoch_draws_other_numbers():
    whole, other_epoch = drawn(2), drawn(2, epoch=2)
    assert all(other_epoch[index] != whole[index] for index in whole)


def seed_everything(seed):
    torch.manual_seed(seed)
    random.seed(seed)
    numpy.random.seed(seed)


def test_without_workers_the_run_s_own_generators_are_drawn_from_and_not_reseeded():
    seed_everything(0)
    first = drawn(0)
    seed_everything(0)
    assert drawn(0) == first
    assert drawn(0) != first, "the main process's generators went on rather than being reseeded"


def test_a_dataset_that_reads_a_batch_at_once_is_read_a_batch_at_a_time_and_seeded_alike():
    whole = drawn(2, dataset=BatchReading())
    assert sorted(draws[0] for draws in whole.values()) == [2.0] * 2 + [3.0] * 27, "one call per batch"
    assert drawn(2, offset=12, dataset=BatchReading()).items() <= whole.items()
