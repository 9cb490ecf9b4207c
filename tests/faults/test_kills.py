"""SIGKILL at random and at chosen instants, over training and saving: every rerun succeeds, `latest` never names a
checkpoint that fails verification, and the finished run is bit-equal to one that was never killed."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from tests import zygote
from tests.runs import (
    LAUNCH_DEFAULTS,
    SCRIPTS,
    assert_ok,
    assert_same_weights,
    built_once,
    environment,
    final_weights,
    read_losses,
    run,
    run_dir,
)

# A model whose checkpoint (~2.4 MB with AdamW state) takes a real share of each short step, saved every 2 steps
# with retention on, so kills land in training, in writing, in committing, in pointer updates and in pruning. Each
# test's budget (--steps) is large enough that every kill lands before the run could finish: 9 kills at most 0.3 s
# into training, at least 0.04 s a step, reach step 68 at most; 6 kills at most 1.2 s in (the process writer's) 180.
# (The tests make 7 and 4: each kill is a launch, and the kills at chosen points below cover each phase anyway.)
# The budget is also what the reference and the final rerun train, so it is kept no larger than that.
# A kill at a chosen point of the save lands by the 4th save (step 8).
MODEL = ("--width", "256", "--depth", "2", "--ckpt.interval", "2", "--ckpt.keep_latest_k", "2")
STEP_SLEEP = "0.04"


def reference(tmp_path_factory: pytest.TempPathFactory, steps: int) -> Path:
    """The uninterrupted run of `steps` steps (with its LOSS_LOG), built once per session."""
    args = ("--steps", str(steps), *MODEL)
    return built_once(
        tmp_path_factory,
        f"kills-reference-{steps}",
        lambda root: assert_ok(run("resumable.py", root, *args, LOSS_LOG=root / "losses.jsonl")),
    )


def assert_latest_verifies(root: Path) -> None:
    checkpoints = run_dir(root) / "checkpoints"
    latest = read_pointer(checkpoints, "latest")
    if latest is not None:
        verify_checkpoint(checkpoints / latest)


def kill_at_random(root: Path, args: tuple[str, ...], delay: float, loss_log: Path) -> int:
    """Start the run, wait until it trains (or up to 20 s), wait `delay` more, SIGKILL. Returns the exit code."""
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *args]
    before = loss_log.stat().st_size if loss_log.exists() else 0
    process = zygote.popen(
        command,
        env=environment(LOSS_LOG=loss_log, STEP_SLEEP=STEP_SLEEP),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while process.poll() is None and time.monotonic() < deadline:
        if loss_log.exists() and loss_log.stat().st_size > before:
            break
        time.sleep(0.005)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    return process.wait(timeout=60)


@pytest.mark.parametrize(
    ("mode", "kills", "longest", "steps"),
    [("disabled", 7, 0.3, 80), ("thread", 7, 0.3, 80), ("process", 4, 1.2, 200)],
)
def test_random_kills_never_corrupt_and_resume_bit_exact(tmp_path_factory, tmp_path, mode, kills, longest, steps):
    # Kills this close together often land before a new checkpoint: three in a row would make the run `stuck` (exit
    # 93, tests/faults/test_crash_loop.py); here every kill must resume, so the crash-loop limit is out of reach.
    expected_run = reference(tmp_path_factory, steps)
    args = ("--steps", str(steps), *MODEL, "--ckpt.async_mode", mode)
    args += ("--resilience.max_attempts_without_progress", str(kills + 1))
    root, loss_log = tmp_path / "run", tmp_path / "losses.jsonl"
    rng = random.Random(f"kills-{mode}")
    killed_mid_run = 0
    for _ in range(kills):
        code = kill_at_random(root, args, rng.uniform(0.0, longest), loss_log)
        if code == -signal.SIGKILL:
            killed_mid_run += 1
        assert code in (0, -signal.SIGKILL)
        if list(root.glob("*/*/checkpoints")):
            assert_latest_verifies(root)
        if (run_dir(root) / "model.pth").exists() if list(root.glob("*/*/checkpoints")) else False:
            break
    assert killed_mid_run == kills, "every kill must land while the run is alive"
    assert_ok(run("resumable.py", root, *args))
    assert_latest_verifies(root)
    assert_same_weights(final_weights(expected_run), final_weights(root))
    expected = read_losses(expected_run / "losses.jsonl")
    for position, loss in read_losses(loss_log).items():
        assert expected[position] == loss, f"loss at {position} differs"


@pytest.mark.parametrize("mode", ["disabled", "thread"])
@pytest.mark.parametrize("fault", ["pointer:3", "prune:2", "write:4"])
def test_kill_at_a_chosen_point_of_the_save(tmp_path_factory, tmp_path, mode, fault):
    args = ("--steps", "24", *MODEL, "--ckpt.async_mode", mode)
    root = tmp_path / "run"
    killed = run("resumable.py", root, *args, FAULT=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    assert_latest_verifies(root)
    rerun = run("resumable.py", root, *args)
    assert_ok(rerun)
    assert "resuming from" in rerun.stdout
    if fault.startswith("write"):
        assert "interrupted save" in rerun.stdout
    assert not list((run_dir(root) / "checkpoints").glob(".prune-*"))
    assert_latest_verifies(root)
    assert_same_weights(final_weights(reference(tmp_path_factory, 24)), final_weights(root))
