"""A real disk that fills up during an interval checkpoint's `state.pth`, in every save mode: the save fails with its
real cause (ENOSPC, the path, what it needed against what was free), training goes on, every committed checkpoint
still verifies, and once there is room again the same command resumes and ends bit-equal to a run that never failed.
State that can never be serialized stops the run at its first save instead, in every mode."""

from __future__ import annotations

import re
import subprocess
import uuid
from pathlib import Path

import pytest

from perdure.checkpoints.commit import verify_checkpoint
from perdure.checkpoints.resolve import committed_checkpoints
from perdure.workspace.sidecar import read_sidecar
from tests.disks import fill, mount_or_skip, unmount
from tests.runs import (
    assert_ok,
    assert_same_weights,
    built_once,
    final_weights,
    run,
    run_dir,
    run_ranks,
    start,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)

# ~1.6 MB per checkpoint (AdamW state included). The disk is sized from the uninterrupted run: everything but the
# checkpoints, plus two and a half checkpoints, so the first two saves fit and a later interval save does not, nor the
# final one at step 50. (Async modes may coalesce a plain save into the next one, so which interval save fails first
# depends on the writer's pace; steps are slowed so that it keeps up.)
ARGS = ("--steps", "50", "--ckpt.interval", "10", "--width", "256", "--depth", "2")
PAGE = 4096


def usage(path: Path) -> int:
    """Bytes a tree takes on a tmpfs: whole pages of file data."""
    return sum(-(-file.stat().st_size // PAGE) * PAGE for file in path.rglob("*") if file.is_file())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return built_once(tmp_path_factory, "tmpfs-reference", lambda root: assert_ok(run("resumable.py", root, *ARGS)))


@pytest.fixture
def small_disk(reference, tmp_path):
    checkpoints = run_dir(reference) / "checkpoints"
    one = usage(committed_checkpoints(checkpoints)[-1])  # every checkpoint has the same size
    rest = usage(run_dir(reference)) - usage(checkpoints) - usage(run_dir(reference) / "model.pth")
    disk = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount_or_skip(disk, f"size={(rest + 5 * one // 2) // 1024}k")
    yield disk
    unmount(disk)


@pytest.mark.parametrize("mode", ["disabled", "thread", "process"])
def test_a_disk_that_fills_during_an_interval_save(reference, small_disk, mode):
    result = run("resumable.py", small_disk, *ARGS, "--ckpt.async_mode", mode, STEP_SLEEP="0.03")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # the final save at step 50 cannot be written either: never just a warning
    assert "Traceback" not in result.stderr
    interval = next(line for line in output.splitlines() if "(interval) failed" in line and "Training goes" in line)
    assert "No space left on device (ENOSPC) writing" in interval and "state.pth" in interval
    assert "the checkpoint needs about 1.6 MiB" in interval and "free on that filesystem now" in interval
    assert "step 50/50" in output  # training went on after the failed save
    checkpoints = run_dir(small_disk) / "checkpoints"
    assert not list(checkpoints.glob(".tmp-*")), "the partial directory must be removed"
    committed = committed_checkpoints(checkpoints)
    assert committed and "ckpt-s000000000050" not in [path.name for path in committed]
    for path in committed:
        verify_checkpoint(path)
    failures = read_sidecar(run_dir(small_disk) / "sidecar.json")["attempts"][-1]["save_failures"]
    assert failures and all("ENOSPC" in failure["error"] for failure in failures)

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    rerun = run("resumable.py", small_disk, *ARGS, "--ckpt.async_mode", mode)
    assert_ok(rerun)
    assert f"resuming from {committed[0]}" in rerun.stdout
    assert_same_weights(final_weights(reference), final_weights(small_disk))


def test_a_disk_that_another_job_fills_between_saves(reference, tmp_path):
    """Everything the run writes besides checkpoints (the sidecar, the heartbeat, the log file, metrics) meets the
    full disk too: each is a warning, training goes on to its budget, the exit says the final save failed, in one
    line; with room again the same command resumes and ends bit-equal to the run that never failed."""
    disk, slow = tmp_path / "disk", tmp_path / "slow"
    mount_or_skip(disk, "size=16m")
    slow.touch()
    try:
        process = start("resumable.py", disk, *ARGS, STEP_SLEEP="0.2", SLOW_WHILE=str(slow))
        wait_for(process, disk, "*/*/checkpoints/ckpt-s000000000010")
        fill(disk / "other-job")
        slow.unlink()
        output, _ = process.communicate(timeout=240)
        assert process.returncode == 1, output
        assert "Traceback" not in output and "Logging error" not in output
        assert "step 50/50" in output  # training went on to its budget
        assert re.search(r"^error: checkpoint ckpt-s000000000050 \(\w+\) failed: No space left on device", output, re.M)
        assert "sidecar.json ([Errno 28] No space left on device); training goes on" in output
        committed = committed_checkpoints(run_dir(disk) / "checkpoints")
        assert committed and "ckpt-s000000000050" not in [path.name for path in committed]
        for path in committed:
            verify_checkpoint(path)

        (disk / "other-job").unlink()
        rerun = run("resumable.py", disk, *ARGS)
        assert_ok(rerun)
        assert f"resuming from {committed[0]}" in rerun.stdout
        assert_same_weights(final_weights(reference), final_weights(disk))
    finally:
        unmount(disk)


def test_a_disk_too_full_to_begin_stops_before_training(reference, tmp_path):
    """The attempt's first writes (its metadata, the sidecar, the log) fail: the run stops before training steps it
    could never checkpoint, in one line naming the file, the cause and what is free; no lock is left held, and with
    room the same command trains."""
    disk = tmp_path / "disk"
    mount_or_skip(disk, "size=16k")
    try:
        result = run("resumable.py", disk, *ARGS)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "Traceback" not in result.stderr and "step 1" not in result.stdout
        [line] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert re.match(r"error: cannot begin the attempt in .+: No space left on device \(ENOSPC\) writing /", line)
        assert "free on that filesystem. Free space there (or point --workspace.root at another disk)" in line

        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        assert_ok(run("resumable.py", disk, *ARGS))
        assert_same_weights(final_weights(reference), final_weights(disk))
    finally:
        unmount(disk)


def test_every_rank_stops_when_rank_0_cannot_begin(tmp_path):
    """Rank 0 writes the attempt's records: when it cannot, the others hear why at once (no collective left waiting
    for a rank that is gone, no gloo traceback)."""
    disk = tmp_path / "disk"
    mount_or_skip(disk, "size=16k")
    try:
        results = run_ranks(2, "resumable.py", disk, "--steps", "20", timeout=120)
    finally:
        unmount(disk)
    for rank, result in enumerate(results):
        # Exit 1, not SIGABRT: both ranks leave right after the collective that shared the error
        # (perdure/distributed/gloo_exit.py).
        assert result.returncode == 1, result.stdout
        assert "Traceback" not in result.stdout and "Connection closed by peer" not in result.stdout
        [error] = [line for line in result.stdout.splitlines() if line.startswith(f"[rank{rank}]: error: ")]
        cause = "" if rank == 0 else "WorkspaceError on rank 0: "
        assert error.startswith(f"[rank{rank}]: error: {cause}cannot begin the attempt in "), error


@pytest.mark.parametrize("mode", ["disabled", "thread", "process"])
def test_state_that_cannot_be_saved_stops_the_run_at_its_first_save(tmp_path, mode):
    result = run("resumable.py", tmp_path, "--steps", "30", "--ckpt.async_mode", mode, UNSAVEABLE="1")
    assert result.returncode == 1
    error = result.stderr.strip().splitlines()[-1]
    # In a background mode the first save the writer tries is the one that fails: s10, unless s10 was still queued
    # when s20 came (a loaded machine), which supersedes it before anyone tried to write it.
    first = "ckpt-s000000000010" if mode == "disabled" else r"ckpt-s0000000000[12]0"
    assert re.match(rf"error: checkpoint {first} could not be written: its state cannot be serialized", error), error
    assert "Traceback" not in result.stderr
    assert not committed_checkpoints(run_dir(tmp_path) / "checkpoints")
    assert read_sidecar(run_dir(tmp_path) / "sidecar.json")["status"] == "failed"
