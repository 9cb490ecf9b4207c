"""ResumableSampler: the order of existing runs is unchanged, large datasets get a lazily computed permutation, and a
position saved before permutations had names resumes in the order it was written with."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from perdure.data.loader import ResumableLoader
from perdure.data.sampler import RANDPERM_LIMIT, HashedPermutation, ResumableSampler
from perdure.errors import CheckpointError


def list_based_order(n, *, shuffle, seed, epoch, rank, world_size, drop_last, pad, offset):
    """The sampler as perdure wrote it before: the whole epoch as a Python list (the reference for old runs)."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(n, generator=generator).tolist()
    else:
        order = list(range(n))
    if drop_last:
        total = (n // world_size) * world_size
    elif not pad:
        total = n
    else:
        total = math.ceil(n / world_size) * world_size
    if total > len(order):
        order = (order * math.ceil(total / len(order)))[:total]
    return order[:total][offset + rank :: world_size]


@pytest.mark.parametrize("n", [1, 7, 100, 1001])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_order_of_existing_runs_is_unchanged(n, world_size):
    options = itertools.product([True, False], [False, True], [True, False], [0, 5, 64], [0, 3], range(world_size))
    for shuffle, drop_last, pad, offset, epoch, rank in options:
        sampler = ResumableSampler(
            n, shuffle=shuffle, seed=11, rank=rank, world_size=world_size, drop_last=drop_last, pad=pad
        )
        sampler.set_epoch(epoch, offset)
        expected = list_based_order(
            n, shuffle=shuffle, seed=11, epoch=epoch, rank=rank, world_size=world_size, drop_last=drop_last,
            pad=pad, offset=offset,
        )  # fmt: skip
        assert sampler.permutation == "randperm"
        assert list(sampler) == expected and len(sampler) == len(expected)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 1000, 4099])
def test_the_hashed_permutation_is_a_bijection_keyed_by_seed(n):
    values = HashedPermutation(n, seed=3)(torch.arange(n)).tolist()
    assert sorted(values) == list(range(n))
    assert HashedPermutation(n, seed=3)(torch.arange(n)).tolist() == values
    if n >= 64:
        assert HashedPermutation(n, seed=4)(torch.arange(n)).tolist() != values
        assert values != list(range(n))


def test_hashed_order_splits_between_ranks_and_resumes_by_slicing():
    n, world_size = 1003, 3
    full = ResumableSampler(n, seed=2, permutation="hashed")
    full.set_epoch(5)
    order = list(full)
    assert sorted(order) == list(range(n))
    shares = []
    for rank in range(world_size):
        sampler = ResumableSampler(n, seed=2, rank=rank, world_size=world_size, permutation="hashed")
        sampler.set_epoch(5, offset=300)
        shares.append(list(sampler))
        padded = order + order[: math.ceil(n / world_size) * world_size - n]
        assert shares[-1] == padded[300 + rank :: world_size]
    epoch_six = ResumableSampler(n, seed=2, permutation="hashed")
    epoch_six.set_epoch(6)
    assert list(epoch_six) != order


def test_a_hundred_million_samples_need_no_full_permutation():
    sampler = ResumableSampler(100_000_000, seed=0, rank=1, world_size=4)
    assert sampler.permutation == "hashed" and 100_000_000 > RANDPERM_LIMIT
    sampler.set_epoch(7, offset=73_000_000)
    first = list(itertools.islice(iter(sampler), 1000))
    assert sampler._order is None  # no tensor of the whole epoch was made
    positions = torch.arange(73_000_001, 73_000_001 + 4 * 1000, 4)
    assert first == HashedPermutation(100_000_000, seed=7)(positions).tolist()
    assert len(set(first)) == 1000 and all(0 <= index < 100_000_000 for index in first)


def test_a_position_names_its_permutation_and_an_old_one_means_randperm():
    loader = ResumableLoader(range(RANDPERM_LIMIT + 1), batch_size=4, shuffle=True)
    assert loader.sampler.permutation == "hashed"
    assert loader.position(0, 8)["permutation"] == "hashed"
    loader.restore({"epoch": 0, "offset": 8, "world_size": 1})  # written before permutations had names
    assert loader.sampler.permutation == "randperm"
    with pytest.raises(CheckpointError, match="permutation"):
        loader.restore({"epoch": 0, "offset": 8, "world_size": 1, "permutation": "x" * 500})


def test_a_position_records_the_dataset_length_and_a_restore_tells_a_change():
    loader = ResumableLoader(range(30), batch_size=4, shuffle=True)
    assert loader.position(0, 8)["samples"] == 30
    loader.restore({"epoch": 0, "offset": 8, "world_size": 1})  # written before the length was recorded
    assert loader.length_change() is None
    loader.restore(ResumableLoader(range(24), batch_size=4, shuffle=True).position(0, 8))
    assert loader.length_change() == (24, 30)
    for bad in (True, -3, 2.5, "30"):  # from someone else's checkpoint
        with pytest.raises(CheckpointError, match="dataset length"):
            loader.restore({"epoch": 0, "offset": 8, "world_size": 1, "samples": bad})


def test_an_evaluation_limit_bounds_the_same_samples_on_any_number_of_ranks():
    def read(world_size):
        shares = []
        for rank in range(world_size):
            sampler = ResumableSampler(100, shuffle=False, rank=rank, world_size=world_size, pad=False)
            sampler.set_epoch(0, limit=24)  # e.g. eval.steps 3 of batch size 8
            shares.append(list(sampler))
            assert len(sampler) == len(shares[-1])
        return sorted(index for share in shares for index in share)

    assert read(1) == read(2) == read(3) == list(range(24))


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_count_is_what_iter_epoch_reads_whatever_was_read_before(drop_last):
    """`batch_count(limit)` is the number of batches `iter_epoch(e, 0, limit)` yields on this rank, also right after
    an iteration with another limit: `len()` is not (it keeps the last limit), and a stack that sized an evaluation
    by `len()` evaluated fewer batches at every evaluation (28, 16, 8, 4 of 49 samples)."""
    dataset = torch.utils.data.TensorDataset(torch.arange(49))
    loaders = [
        ResumableLoader(dataset, batch_size=4, shuffle=False, rank=rank, world_size=2, drop_last=drop_last, pad=False)
        for rank in range(2)
    ]
    for loader in loaders:
        for limit in (None, 28, 8, None, 3, 49, 1000):
            expected = len(list(loader.iter_epoch(0, limit=limit)))
            list(loader.iter_epoch(0, limit=12))  # a different last limit
            assert loader.batch_count(limit) == expected, limit
    assert [loader.batch_count() for loader in loaders] == ([6, 6] if drop_last else [7, 6])
