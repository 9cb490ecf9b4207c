"""A collate function of the program's own (`self.collate_fns`): the batches it makes can be anything, and the data
position, epoch ends and evaluation weights still count samples as the sampler cut them. (Kill -9 + rerun bit-exact
with one: test_resume's packed cases.)"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import TensorDataset

from perdure import PerdureError
from perdure.data.batch import batch_length
from perdure.data.loader import ResumableLoader
from tests.scripts.resumable import ResumableRunner, make_config, packed


def one_row(samples):
    """Every batch is one row, whatever its size: a count read from the batch would say 1."""
    return torch.cat([x for x, _ in samples]).unsqueeze(0)


@pytest.mark.parametrize(
    ("size", "batch", "world", "drop_last", "pad", "offset", "limit"),
    [
        (50, 8, 1, False, True, 0, None),
        (50, 8, 3, False, True, 9, None),
        (50, 8, 3, True, False, 12, None),
        (50, 7, 4, False, False, 0, 30),
        (9, 4, 4, False, False, 0, None),  # uneven evaluation shares
        (64, 8, 2, False, True, 64, None),  # an epoch already read
    ],
)
def test_the_sizes_counted_are_the_sizes_of_the_batches(size, batch, world, drop_last, pad, offset, limit):
    dataset = TensorDataset(torch.arange(size, dtype=torch.float32).unsqueeze(1), torch.zeros(size))
    for rank in range(world):
        options = {"batch_size": batch, "shuffle": True, "drop_last": drop_last, "rank": rank, "world_size": world}
        plain = ResumableLoader(dataset, **options, pad=pad)
        expected = [batch_length(b) for b in plain.iter_epoch(1, offset, limit)]
        rowed = ResumableLoader(dataset, **options, pad=pad, collate_fn=one_row)
        batches = list(rowed.iter_epoch(1, offset, limit))
        assert all(b.shape[0] == 1 for b in batches)
        assert [rowed.take_samples(1) for _ in batches] == expected


def test_batches_read_ahead_are_taken_in_order_and_a_new_epoch_forgets_them():
    dataset = TensorDataset(torch.zeros(10, 1), torch.zeros(10))
    loader = ResumableLoader(dataset, batch_size=4, shuffle=False, collate_fn=one_row)
    batches = loader.iter_epoch(0)
    list(itertools.islice(batches, 3))  # 4, 4, 2
    assert loader.take_samples(2) == 8
    assert loader.take_samples(1) == 2
    next(iter(loader.iter_epoch(1)))
    assert loader.take_samples(1) == 4


def config(root, **settings):
    return make_config(root, **{"steps": 6, "ckpt.interval": 3, **settings})


def test_an_epoch_of_one_row_batches_ends_where_the_samples_end(tmp_path):
    class Rows(ResumableRunner):
        def __init__(self, config):
            super().__init__(config)
            self.collate_fns = dict.fromkeys(self.datasets, packed)

    runner = Rows(config(tmp_path, epochs=2, steps=None, **{"dataloader.batch_size": 16}))
    runner.train()
    samples = len(runner.datasets["train"])
    assert runner.state.epoch == 2
    assert runner.state.global_step == 2 * -(-samples // 16)  # every batch of both epochs, not one sample a batch


def test_evaluation_weighs_each_batch_by_its_samples(tmp_path):
    weights = []

    class Rows(ResumableRunner):
        def __init__(self, config):
            super().__init__(config)
            self.collate_fns["val"] = packed  # its first tensor has a row more than the batch has samples

        def evaluate_step(self, batch):
            weights.append(len(batch["offsets"]) - 1)
            return {"n": float(len(batch["offsets"]) - 1)}

    # 40 validation samples: batches of 16, 16 and 8
    metrics = Rows(config(tmp_path, **{"dataloader.batch_size": 16})).evaluate(["val"])["val"]
    assert weights == [16, 16, 8]
    assert metrics["n"] == pytest.approx((16 * 16 + 16 * 16 + 8 * 8) / 40)


@pytest.mark.parametrize(
    ("split", "value", "message"),
    [
        ("vall", packed, "self.collate_fns['vall']: no dataset is named 'vall'; the splits are 'train', 'val'"),
        ("train", "pad", "self.collate_fns['train']: a str is not callable"),
    ],
)
def test_a_collate_function_for_no_split_or_not_a_function_is_refused(tmp_path, split, value, message):
    class Bad(ResumableRunner):
        def __init__(self, config):
            super().__init__(config)
            self.collate_fns[split] = value

    with pytest.raises(PerdureError) as error:
        Bad(config(tmp_path))
    assert message in str(error.value)
