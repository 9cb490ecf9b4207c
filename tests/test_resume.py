"""Bit-exact resume: a run SIGKILLed at a random instant after a checkpoint and rerun ends exactly like one that
never stopped — every loss after the restart and the final parameters are equal."""

from __future__ import annotations

import random

import pytest
import torch

from tests.runs import assert_ok, assert_same_weights, final_weights, read_losses, run, run_dir, run_until_killed

SCENARIOS = {
    # step mode, dropout, a warmup + cosine schedule, several epochs crossed after the resume
    "steps": (["--steps", "40", "--sched.name", "cosine", "--sched.warmup_steps", "5"], "ckpt-s000000000010"),
    "steps-workers": (["--steps", "30", "--dataloader.num_workers", "2"], "ckpt-s000000000010"),
    # epoch mode killed mid-epoch: 13 batches per epoch, extra saves every 4 steps
    "epochs-mid-epoch": (["--epochs", "3", "--ckpt.interval_steps", "4"], "ckpt-s000000000016"),
    "epochs-workers": (
        ["--epochs", "3", "--ckpt.interval_steps", "4", "--dataloader.num_workers", "2"],
        "ckpt-s000000000008",
    ),
    # async saves: the snapshot overlaps the next forward / backward, the write happens in the background
    "async-thread": (["--steps", "40", "--ckpt.async_mode", "thread", "--ckpt.interval", "5"], "ckpt-s000000000010"),
    # the writer process takes a while to start, so plain saves coalesce: wait for whichever commits first
    "async-process-epochs": (
        ["--epochs", "4", "--ckpt.interval_steps", "4", "--ckpt.async_mode", "process"],
        "ckpt-s*",
    ),
    # a collate of the program's own whose batches are one flat row (a sampler-free count would be wrong): epochs
    # end and the position is saved where they really are; with workers its random masks draw the same after a resume
    "packed-epochs-workers": (
        ["--epochs", "2", "--ckpt.interval_steps", "4", "--dataloader.num_workers", "2"],
        "ckpt-s000000000008",
    ),
    # bf16 autocast with gradient accumulation over a partial last window, EMA and clipping
    "bf16-accum": (
        ["--steps", "24", "--precision", "bf16", "--accum_steps", "3"]
        + ["--ema.enabled", "true", "--max_grad_norm", "1.0"],
        "ckpt-s000000000010",
    ),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sigkill_and_rerun_is_bit_exact(tmp_path, name):
    args, checkpoint = SCENARIOS[name]
    # With workers, a random transform in them (noise from torch, random and numpy) draws the same after the resume.
    augment = {"AUGMENT": "1"} if "workers" in name else {}
    # A momentum teacher of the user's own (`self.checkpointed`), updated after each step: saved and restored too.
    if name in ("async-thread", "bf16-accum"):
        augment["TEACHER"] = "1"
    if name.startswith("packed"):
        augment["PACKED"] = "1"
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    finals = {"reference": tmp_path / "reference.pt", "interrupted": tmp_path / "interrupted.pt"}
    assert_ok(
        run(
            "resumable.py",
            reference,
            *args,
            **augment,
            LOSS_LOG=tmp_path / "reference.jsonl",
            FINAL_STATE=finals["reference"],
        )
    )

    delay = random.Random(name).uniform(0.0, 0.15)
    killed = run_until_killed(
        "resumable.py",
        interrupted,
        *args,
        when_exists=f"*/*/checkpoints/{checkpoint}/manifest.json",
        delay=delay,
        STEP_SLEEP="0.1" if "process" in name else "0.04",  # the writer process needs ~2 s to start
        LOSS_LOG=tmp_path / "killed.jsonl",
        **augment,
    )
    assert killed.returncode == -9
    assert not (run_dir(interrupted) / "model.pth").exists(), "the kill landed after training finished"

    rerun = run(
        "resumable.py",
        interrupted,
        *args,
        **augment,
        LOSS_LOG=tmp_path / "rerun.jsonl",
        FINAL_STATE=finals["interrupted"],
    )
    assert_ok(rerun)
    assert "resuming from" in rerun.stdout

    expected = read_losses(tmp_path / "reference.jsonl")
    resumed = read_losses(tmp_path / "rerun.jsonl")
    assert resumed, "the rerun trained nothing"
    assert min(resumed) > (0, 0, 0), "the rerun started over instead of resuming"
    for position, loss in resumed.items():
        assert expected[position] == loss, f"loss at (epoch, step, micro) {position} differs after the resume"
    assert max(resumed) == max(expected)
    assert_same_weights(final_weights(reference), final_weights(interrupted))
    if "TEACHER" in augment:
        expected_teacher, resumed_teacher = (torch.load(finals[key])["teacher"] for key in ("reference", "interrupted"))
        assert resumed_teacher["updates"] == expected_teacher["updates"] > 0
        assert torch.equal(resumed_teacher["center"], expected_teacher["center"])
        assert_same_weights(resumed_teacher["net"], expected_teacher["net"])
    if "--ema.enabled" in args:
        assert_same_weights(final_weights(reference, "model-ema.pth"), final_weights(interrupted, "model-ema.pth"))
