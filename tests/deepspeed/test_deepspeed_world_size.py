"""A ZeRO-3 checkpoint written by 2 ranks resumes on 1: converted to DeepSpeed's universal format on restore (kept as
a derived checkpoint beside the original), the weights and optimizer state restored exactly (not a fresh start, as
DeepSpeed #6691 reported for universal resumes), every sample of the interrupted epoch seen once."""

from __future__ import annotations

import pytest
import torch

from perdure.checkpoints.commit import verify_checkpoint
from perdure.checkpoints.deepspeed_engine import read_deepspeed_weights
from perdure.checkpoints.deepspeed_universal import derived_path, prune_derived
from tests.deepspeed.conftest import ARGS, TIMEOUT
from tests.runs import assert_all_ok, assert_same_weights, epoch_samples, run_dir, run_ranks

pytestmark = pytest.mark.timeout(300)


def test_a_zero3_checkpoint_of_two_ranks_resumes_on_one(tmp_path):
    root, args = tmp_path / "runs", (*ARGS, "--deepspeed.zero_stage", "3", "--ema.enabled", "true")
    first = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, KILL_AT_STEP="7", SAMPLE_LOG="1",
                      LOSS_LOG=tmp_path / "first-{rank}.jsonl")  # fmt: skip
    assert all(result.returncode != 0 for result in first)
    checkpoint = run_dir(root) / "checkpoints" / "ckpt-s000000000005"
    assert verify_checkpoint(checkpoint)["world_size"] == 2

    env = {"SAMPLE_LOG": "1", "RESTORED_STATE": tmp_path / "r.pth", "LOSS_LOG": tmp_path / "second-{rank}.jsonl"}
    second = run_ranks(1, "resumable.py", root, *args, timeout=TIMEOUT, **env)
    assert_all_ok(second)
    output = second[0].stdout
    assert "written by 2 ranks, this run has 1: converting it to DeepSpeed's universal checkpoint format" in output
    assert "TOPOLOGY CHANGE" in output and "(step 5)" in output

    # Restored exactly: the fp32 weights of the 2-rank checkpoint, and Adam's step count (a fresh start would be 0).
    restored = torch.load(tmp_path / "r.pth", weights_only=True)
    assert_same_weights(restored["weights"], read_deepspeed_weights(checkpoint))
    assert restored["steps"] == [5.0]
    # and the EMA, averaged by each of the 2 ranks over its own partition, whole on the one rank
    assert_same_weights(restored["ema"], read_deepspeed_weights(checkpoint, ema=True))

    derived = verify_checkpoint(derived_path(checkpoint))  # kept beside the original, which is unchanged
    assert derived["derived_from"]["name"] == checkpoint.name and derived["backend"] == "deepspeed-universal"
    assert verify_checkpoint(checkpoint)["world_size"] == 2
    assert verify_checkpoint(run_dir(root) / "checkpoints" / "ckpt-s000000000014")["world_size"] == 1

    before, _ = epoch_samples(tmp_path, "first", 2, lambda step: step < 5)
    after, steps = epoch_samples(tmp_path, "second", 1, lambda step: True)
    assert min(steps) == 5 and max(steps) == 13, "training continued from the checkpoint's step"
    assert sorted(before + after) == list(range(48)), "every sample of the interrupted epoch exactly once"


def test_a_derived_universal_checkpoint_goes_with_its_original(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for name in ("ckpt-s000000000005", "ckpt-s000000000010"):
        (checkpoints / name).mkdir(parents=True)
        (derived_path(checkpoints / name) / "engine").mkdir(parents=True)
    leftover = checkpoints / "universal" / ".tmp-ckpt-s000000000010-123-abcd"  # a commit that was killed
    leftover.mkdir()
    (checkpoints / "universal" / "notes").mkdir()  # not perdure's: left alone
    (checkpoints / "ckpt-s000000000005").rmdir()  # retention removed the original
    prune_derived(checkpoints)
    assert sorted(path.name for path in (checkpoints / "universal").iterdir()) == ["ckpt-s000000000010", "notes"]
