"""keep_latest_k keeps exactly what it should, across a restart too; best and patience survive a resume."""

from __future__ import annotations

import torch

from tests.runs import assert_ok, run, run_dir

ARGS = ("--steps", "40", "--ckpt.interval", "5", "--ckpt.keep_latest_k", "2", "--dataset_size", "64")


def committed(root):
    checkpoints = run_dir(root) / "checkpoints"
    return sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("ckpt-"))


def pointer(root, name):
    return (run_dir(root) / "checkpoints" / name).read_text().strip()


def final_state(root):
    return torch.load(run_dir(root) / "checkpoints" / pointer(root, "latest") / "state.pth", weights_only=True)["state"]


def step_name(step):
    return f"ckpt-s{step:012d}"


def test_retention_and_best_across_a_restart(tmp_path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    assert_ok(run("resumable.py", reference, *ARGS))
    expected = final_state(reference)
    assert committed(reference) == sorted({step_name(35), step_name(40), pointer(reference, "best")})

    killed = run("resumable.py", interrupted, *ARGS, KILL_AT_STEP="27")
    assert killed.returncode == -9
    state_at_kill = torch.load(run_dir(interrupted) / "checkpoints" / step_name(25) / "state.pth", weights_only=True)[
        "state"
    ]
    assert committed(interrupted) == sorted({step_name(20), step_name(25), pointer(interrupted, "best")})
    assert state_at_kill["best_step"] == int(pointer(interrupted, "best").removeprefix("ckpt-s"))

    assert_ok(run("resumable.py", interrupted, *ARGS))
    # The checkpoint this attempt resumed from (25) is kept until a later attempt; latest and best always.
    assert committed(interrupted) == sorted({step_name(25), step_name(35), step_name(40), pointer(reference, "best")})
    assert pointer(interrupted, "best") == pointer(reference, "best")

    resumed = final_state(interrupted)
    for key in ("results", "best_score", "best_step", "patience_count", "global_step", "epoch"):
        assert resumed[key] == expected[key], key
    assert len(resumed["results"]) == 8


def test_early_stopping_patience_survives_a_resume(tmp_path):
    args = ("--steps", "200", "--ckpt.interval", "2", "--score.patience", "3", "--optim.lr", "0.3")
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    assert_ok(run("resumable.py", reference, *args))
    expected = final_state(reference)
    assert expected["early_stopped"] and expected["global_step"] < 200

    stop_step = expected["global_step"]
    killed = run("resumable.py", interrupted, *args, KILL_AT_STEP=str(stop_step - 1))
    assert killed.returncode == -9
    assert_ok(run("resumable.py", interrupted, *args))
    resumed = final_state(interrupted)
    assert resumed["early_stopped"] and resumed["global_step"] == stop_step
    assert resumed["results"] == expected["results"]


def test_by_default_the_three_newest_checkpoints_and_best_are_kept(tmp_path):
    from tests.scripts.resumable import ResumableRunner, make_config

    runner = ResumableRunner(make_config(tmp_path, steps=16, **{"ckpt.interval": 2, "eval.interval": 2}))
    assert runner.config.ckpt.keep_latest_k == 3  # the documented default (docs/checkpoints.md#retention)
    runner.train()
    assert committed(tmp_path) == sorted({step_name(12), step_name(14), step_name(16), pointer(tmp_path, "best")})
    assert pointer(tmp_path, "latest") == step_name(16)
