"""stack=deepspeed: a run killed on every rank and rerun ends bit-equal to the run that never stopped (ZeRO-1 in bf16
with accumulation, ZeRO-2, ZeRO-3 with EMA), and a damaged newest checkpoint is quarantined for the one before it."""

from __future__ import annotations

import pytest
import torch

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from perdure.checkpoints.deepspeed_engine import read_deepspeed_weights
from tests.deepspeed.conftest import CONFIGS, TIMEOUT, args_of
from tests.runs import assert_all_ok, assert_same_weights, final_weights, read_losses, run_dir, run_ranks

pytestmark = pytest.mark.timeout(400)


def assert_continues_reference(reference, root, logs, resumed_from):
    for rank in range(2):
        expected = read_losses(reference / f"losses-{rank}.jsonl")
        resumed = read_losses(logs / f"rerun-{rank}.jsonl")
        assert resumed and min(position[1] for position in resumed) == resumed_from, "resumed from that checkpoint"
        for position, loss in resumed.items():
            assert expected[position] == loss, f"rank {rank}: loss at {position} differs"
    for name in ("model.pth", "model-ema.pth"):
        if (run_dir(reference) / name).exists():
            assert_same_weights(final_weights(reference, name), final_weights(root, name))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_kill_of_every_rank_and_rerun_is_bit_exact(references, killed, tmp_path, config):
    reference, root = references(config), killed(config, tmp_path / "runs")
    checkpoints = run_dir(root) / "checkpoints"
    newest = read_pointer(checkpoints, "latest")
    manifest = verify_checkpoint(checkpoints / newest)
    assert manifest["backend"] == "deepspeed" and manifest["world_size"] == 2
    assert not (checkpoints / newest / "latest").exists(), "DeepSpeed's own latest file is never written"
    logs = tmp_path / "rerun-{rank}.jsonl"
    rerun = run_ranks(2, "resumable.py", root, *args_of(config), timeout=TIMEOUT, LOSS_LOG=logs)
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout and newest in rerun[0].stdout
    assert_continues_reference(reference, root, tmp_path, manifest["global_step"])


def test_the_export_is_the_engine_weights_gathered_from_every_rank(references):
    reference = references("zero3-ema")
    exported = final_weights(reference)
    gathered = torch.load(reference / "gathered.pth", weights_only=True)["weights"]
    assert_same_weights(exported, gathered)
    assert all(tensor.dtype == torch.float32 for tensor in exported.values())
    # gathered from the live engine one parameter at a time: the weights of the checkpoint it committed last, as
    # DeepSpeed's zero-to-fp32 routine reads them from every rank's optimizer partition
    checkpoints = run_dir(reference) / "checkpoints"
    assert_same_weights(exported, read_deepspeed_weights(checkpoints / read_pointer(checkpoints, "latest")))


def test_a_truncated_shard_of_the_newest_checkpoint_falls_back_to_the_previous_one(references, killed, tmp_path):
    """(An altered file fails the same verification by its checksum instead of its size: tests/test_corruption.py.)"""
    reference, root = references("zero2"), killed("zero2", tmp_path / "runs")
    checkpoints = run_dir(root) / "checkpoints"
    shard = checkpoints / "ckpt-s000000000010" / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    rerun = run_ranks(2, "resumable.py", root, *args_of("zero2"), timeout=TIMEOUT,
                      LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")  # fmt: skip
    assert_all_ok(rerun)
    assert "ckpt-s000000000010" in rerun[0].stdout and "resuming from" in rerun[0].stdout
    assert (checkpoints / "quarantine").is_dir() and any((checkpoints / "quarantine").iterdir())
    assert_continues_reference(reference, root, tmp_path, 5)
    assert verify_checkpoint(checkpoints / read_pointer(checkpoints, "latest"))["global_step"] == 14
