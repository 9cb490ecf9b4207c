"""Iterable (streaming) datasets: one with state resumes exactly after a SIGKILL, on 1 and 2 ranks; one without
state is warned about and restarts its stream."""

from __future__ import annotations

import pytest

from perdure.data.iterable import NodeDataset
from perdure.data.loader import ResumableLoader
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
