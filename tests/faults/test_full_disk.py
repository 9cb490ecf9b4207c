"""A full disk during a save: the partial directory goes, every committed checkpoint stays valid, the failure is
reported, and training goes on (periodic saves, `ckpt.on_error=warn`) or the exit status says it failed."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pytest

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from perdure.checkpoints.resolve import committed_checkpoints
from tests.disks import mount_or_skip, unmount
from tests.runs import assert_ok, assert_same_weights, built_once, final_weights, run, run_dir

ARGS = ("--steps", "40", "--ckpt.interval", "10")
# Each save writes state.pth and rank00000.pth through the patched writer: call 3 is the second save's state.pth;
# from call 7 on the disk stays full, so the save at step 40, the position training ends at, fails.
SECOND_SAVE, FINAL_SAVE = "enospc:3", "enospc:7+"


def assert_committed_intact(root: Path) -> list[str]:
    checkpoints = run_dir(root) / "checkpoints"
    assert not list(checkpoints.glob(".tmp-*")), "the partial directory must be removed"
    names = [path.name for path in committed_checkpoints(checkpoints)]
    for name in names:
        verify_checkpoint(checkpoints / name)
    verify_checkpoint(checkpoints / read_pointer(checkpoints, "latest"))
    return names


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return built_once(tmp_path_factory, "full-disk-reference", lambda root: assert_ok(run("resumable.py", root, *ARGS)))


@pytest.mark.parametrize("mode", ["disabled", "thread"])
def test_failed_periodic_save_warns_and_training_goes_on(reference, tmp_path, mode):
    result = run("resumable.py", tmp_path, *ARGS, "--ckpt.async_mode", mode, FAULT=SECOND_SAVE)
    assert_ok(result)
    assert "ckpt-s000000000020 (interval) failed" in result.stdout
    assert "No space left on device" in result.stdout
    assert "every committed checkpoint is intact" in result.stdout
    names = assert_committed_intact(tmp_path)
    assert "ckpt-s000000000020" not in names and "ckpt-s000000000040" in names
    assert_same_weights(final_weights(reference), final_weights(tmp_path))
    attempt = json.loads((run_dir(tmp_path) / "sidecar.json").read_text())["attempts"][-1]
    assert [failure["checkpoint"] for failure in attempt["save_failures"]] == ["ckpt-s000000000020"]


def test_failed_save_with_on_error_raise_exits_non_zero(tmp_path):
    result = run("resumable.py", tmp_path, *ARGS, "--ckpt.on_error", "raise", FAULT=SECOND_SAVE)
    assert result.returncode != 0
    assert "No space left on device" in result.stderr and "Traceback" not in result.stderr
    assert assert_committed_intact(tmp_path) == ["ckpt-s000000000010"]


def test_failed_final_save_exits_non_zero(tmp_path):
    result = run("resumable.py", tmp_path, *ARGS, FAULT=FINAL_SAVE)
    assert result.returncode != 0
    assert "ckpt-s000000000040 (interval) failed" in result.stderr  # the budget's last step: a final save
    assert assert_committed_intact(tmp_path)[0] == "ckpt-s000000000030"
    assert not (run_dir(tmp_path) / "model.pth").exists()


def test_a_really_full_tmpfs(reference, tmp_path):
    disk = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
    mount_or_skip(disk, "size=600k")
    try:
        # ~190 KB per checkpoint: three fit, the fourth does not.
        args = (*ARGS, "--width", "96", "--depth", "2")
        result = run("resumable.py", disk, *args)
        assert result.returncode != 0, result.stdout
        assert "No space left on device" in result.stdout + result.stderr
        assert_committed_intact(disk)
        # Free space elsewhere: the same run, moved to a roomy disk, resumes and finishes exactly.
        roomy = tmp_path / "roomy"
        shutil.copytree(disk, roomy)
    finally:
        unmount(disk)
    rerun = run("resumable.py", roomy, *args)
    assert_ok(rerun)
    reference_wide = tmp_path / "reference-wide"
    assert_ok(run("resumable.py", reference_wide, *args))
    assert_same_weights(final_weights(reference_wide), final_weights(roomy))
