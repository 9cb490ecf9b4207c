"""Iterable (streaming) datasets: one with state resumes exactly after a SIGKILL, on 1 and 2 ranks; one without
state is warned about and restarts its stream."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset

from perdure.data.iterable import NodeDataset
from perdure.data.loader import ResumableLoader
from perdure.data.sample_seeds import SEEDS_KEY, SeededStream
from perdure.errors import CheckpointError
from tests.runs import assert_all_ok, assert_same_weights, final_weights, read_losses, run_ranks
from tests.scripts.resumable import ResumableRunner, StatelessStream, Stream, Synthetic, make_config

ARGS = ("--steps", "30", "--ckpt.interval", "10", "--dataset_size", "96")  # 12 batches of 8: epochs end at 12, 24


@pytest.fixture(scope="module", params=[1, 2], ids=["1-rank", "2-ranks"])
def reference(request, tmp_path_factory):
    world_size = request.param
    root = tmp_path_factory.mktemp(f"stream-{world_size}")
    log = str(root / "losses-{rank}.jsonl")
    assert_all_ok(run_ranks(world_size, "resumable.py", root, *ARGS, ITERABLE="stateful", LOSS_LOG=log))
    return world_size, root


def test_a_stream_with_state_resumes_exactly_after_a_kill(reference, tmp_path):
    world_size, expected = reference
    killed = run_ranks(world_size, "resumable.py", tmp_path, *ARGS, ITERABLE="stateful", KILL_AT_STEP="17")
    assert all(result.returncode == -9 for result in killed)  # after the step-10 checkpoint, mid-epoch
    log = str(tmp_path / "rerun-{rank}.jsonl")
    resumed = run_ranks(world_size, "resumable.py", tmp_path, *ARGS, ITERABLE="stateful", LOSS_LOG=log)
    assert_all_ok(resumed)
    assert "resuming from" in resumed[0].stdout and "restarts its stream" not in resumed[0].stdout
    for rank in range(world_size):
        reference_losses = read_losses(expected / f"losses-{rank}.jsonl")
        resumed_losses = read_losses(tmp_path / f"rerun-{rank}.jsonl")
        assert min(resumed_losses)[1] == 10 and max(resumed_losses)[1] == 29  # through the epoch end at 24
        assert {position: reference_losses[position] for position in resumed_losses} == resumed_losses
    assert_same_weights(final_weights(expected), final_weights(tmp_path))


def test_a_stream_without_state_is_warned_about_and_restarts(tmp_path, capsys):
    runner = ResumableRunner(make_config(tmp_path, steps=3))
    runner.datasets["train"] = StatelessStream(96, 1, 0, 1)
    capsys.readouterr()
    runner.dataloaders.clear()
    runner.build_dataloaders()
    output = capsys.readouterr().out
    assert "WARNING the 'train' dataset StatelessStream" in output
    assert "restarts its stream from the beginning" in output
    loader = runner.dataloaders["train"]
    first = next(iter(loader.iter_epoch(0)))
    saved = loader.position(0, 8)
    assert "loader" not in saved  # nothing to restore: a resume reads the stream from its start
    again = ResumableLoader(StatelessStream(96, 1, 0, 1), batch_size=8, shuffle=False)
    again.restore(saved)
    assert next(iter(again.iter_epoch(0)))[0].equal(first[0])


def test_a_stream_with_state_continues_where_its_position_says():
    loader = ResumableLoader(Stream(96, 1, 0, 1), batch_size=8, shuffle=False)
    batches = iter(loader.iter_epoch(0))
    next(batches), next(batches)
    saved = loader.position(0, 16)
    expected = next(batches)
    again = ResumableLoader(Stream(96, 1, 0, 1), batch_size=8, shuffle=False)
    again.restore(saved)
    assert next(iter(again.iter_epoch(0)))[0].equal(expected[0])


def test_a_torchdata_node_pipeline_is_a_resumable_dataset():
    from torchdata.nodes import IterableWrapper

    samples = Synthetic(40, seed=3)
    loader = ResumableLoader(IterableWrapper([samples[i] for i in range(40)]), batch_size=4, shuffle=False)
    assert isinstance(loader.dataset, NodeDataset)
    batches = iter(loader.iter_epoch(0))
    for _ in range(3):
        next(batches)
    saved = loader.position(0, 12)
    expected = next(batches)
    again = ResumableLoader(IterableWrapper([samples[i] for i in range(40)]), batch_size=4, shuffle=False)
    again.restore(saved)
    assert next(iter(again.iter_epoch(0)))[0].equal(expected[0])


def test_random_transforms_of_a_stream_read_by_workers_resume_exactly_after_a_kill(tmp_path):
    """Each worker seeded its generators once, when it started: a resumed run's new workers drew from the start of
    their streams of random numbers, so every sample after a resume got other noise (all 20 resumed losses differed)."""
    args = (*ARGS, "--dataloader.num_workers", "2")
    env = {"ITERABLE": "stateful", "AUGMENT": "1"}
    reference = run_ranks(1, "resumable.py", tmp_path / "reference", *args, LOSS_LOG=str(tmp_path / "reference.jsonl"),
                          **env)  # fmt: skip
    assert_all_ok(reference)
    killed = run_ranks(1, "resumable.py", tmp_path / "run", *args, KILL_AT_STEP="17", **env)
    assert killed[0].returncode == -9
    resumed = run_ranks(1, "resumable.py", tmp_path / "run", *args, LOSS_LOG=str(tmp_path / "rerun.jsonl"), **env)
    assert_all_ok(resumed)
    expected, losses = read_losses(tmp_path / "reference.jsonl"), read_losses(tmp_path / "rerun.jsonl")
    assert min(losses)[1] == 10 and max(losses)[1] == 29
    assert {position: expected[position] for position in losses} == losses
    assert_same_weights(final_weights(tmp_path / "reference"), final_weights(tmp_path / "run"))


def test_the_seeds_of_a_stream_worker_are_checked_and_an_older_state_still_loads():
    stream = SeededStream(Stream(96, 1, 0, 1), seed=0, rank=0)
    for seeds in ({"count": -1, "passes": 0}, {"count": "3", "passes": 0}, {"count": 1}, [1, 2]):
        with pytest.raises(CheckpointError, match="stream seeds .* are not two non-negative counts"):
            stream.load_state_dict({"stream": {"position": 0, "passes": 0}, SEEDS_KEY: seeds})
    stream.load_state_dict({"position": 5, "passes": 2})  # the stream's own state, as perdure saved it before
    assert (stream.dataset.position, stream.dataset.passes, stream.count, stream.passes) == (5, 2, 0, 0)
    stream.load_state_dict({"stream": {"position": 7, "passes": 1}, SEEDS_KEY: {"count": 7, "passes": 1}})
    assert stream.state_dict() == {"stream": {"position": 7, "passes": 1}, SEEDS_KEY: {"count": 7, "passes": 1}}


class Noisy(IterableDataset):
    """Eight samples per pass, each a draw from torch's global generator (a random transform's noise)."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        while self.position < 8:
            self.position += 1
            yield torch.rand(())
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def test_workers_of_a_stream_draw_anew_each_epoch_and_alike_for_the_same_epoch():
    """Each epoch starts new workers from the dataset as the main process holds it (a copy whose pass never
    advanced): seeded from the run's seed alone, every epoch would repeat the first one's noise."""

    def epochs(loader):
        return [torch.cat(list(loader.iter_epoch(epoch))) for epoch in range(3)]

    first = epochs(ResumableLoader(Noisy(), batch_size=4, shuffle=False, num_workers=2, seed=5))
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    again = epochs(ResumableLoader(Noisy(), batch_size=4, shuffle=False, num_workers=2, seed=5))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    other_rank = epochs(ResumableLoader(Noisy(), batch_size=4, shuffle=False, num_workers=2, seed=5, rank=1))
    assert not torch.equal(first[0], other_rank[0])


class Reshuffled(Noisy):
    """A stream whose order is a function of the epoch it is told (`set_epoch`), as Hugging Face streaming datasets."""

    def __init__(self):
        super().__init__()
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(8, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        while self.position < 8:
            self.position += 1
            yield torch.tensor(order[self.position - 1])
        self.position = 0


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_with_set_epoch_is_told_each_epoch_also_in_its_workers(workers):
    """Each epoch's workers start from the stream as the main process holds it: a pass counter of its own never
    advances there, so perdure tells it the epoch, in the main process, before each epoch."""
    loader = ResumableLoader(Reshuffled(), batch_size=8, shuffle=False, num_workers=workers)
    orders = [torch.cat(list(loader.iter_epoch(epoch))).tolist() for epoch in range(3)]
    expected = [torch.randperm(8, generator=torch.Generator().manual_seed(epoch)).tolist() for epoch in range(3)]
    assert orders == [order * max(workers, 1) for order in expected]  # each worker reads the whole (unsharded) stream
