"""Every way a checkpoint can be broken on disk: the run quarantines it, warns, falls back to the newest checkpoint
that verifies, and still finishes bit-equal to a run that was never interrupted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.runs import assert_ok, assert_same_weights, built_once, final_weights, read_losses, run, run_dir

ARGS = ("--steps", "40", "--ckpt.interval", "10")
STEP = "ckpt-s{:012d}"


def _latest(checkpoints: Path) -> Path:
    return checkpoints / STEP.format(30)


def _rewrite_manifest(checkpoints: Path) -> None:
    manifest_path = _latest(checkpoints) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["state.pth"]["size"] += 1
    manifest_path.write_text(json.dumps(manifest))


def _truncate(checkpoints: Path) -> None:
    state = _latest(checkpoints) / "state.pth"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])


def _flip_byte(checkpoints: Path) -> None:
    state = _latest(checkpoints) / "state.pth"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))


def _leave_staging(checkpoints: Path) -> None:
    staging = checkpoints / ".tmp-ckpt-s000000000040-4242-deadbeef"
    staging.mkdir()
    (staging / "state.pth").write_bytes((_latest(checkpoints) / "state.pth").read_bytes()[:1000])


# name: (how to break the copy of a run killed at step 35, step it must resume from, what must be quarantined)
CASES = {
    "latest-missing": (lambda c: (c / "latest").unlink(), 30, None),
    "latest-garbage": (lambda c: (c / "latest").write_text("\x00\x17 not a checkpoint\n"), 30, None),
    "latest-dangling": (lambda c: (c / "latest").write_text(STEP.format(90) + "\n"), 30, None),
    "manifest-missing": (lambda c: (_latest(c) / "manifest.json").unlink(), 20, STEP.format(30)),
    "manifest-unreadable": (lambda c: (_latest(c) / "manifest.json").write_text("{not json"), 20, STEP.format(30)),
    "manifest-disagrees": (_rewrite_manifest, 20, STEP.format(30)),
    "file-truncated": (_truncate, 20, STEP.format(30)),
    "file-altered": (_flip_byte, 20, STEP.format(30)),
    "staging-left-by-kill": (_leave_staging, 30, "tmp-ckpt-s000000000040"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):

    def build(base):
        assert_ok(run("resumable.py", base / "reference", *ARGS, LOSS_LOG=base / "reference.jsonl"))
        killed = run("resumable.py", base / "killed", *ARGS, KILL_AT_STEP="35")
        assert killed.returncode == -9, killed.stdout + killed.stderr

    return built_once(tmp_path_factory, "corruption-runs", build)  # read only: each test copies the killed run


@pytest.mark.parametrize("case", list(CASES))
def test_broken_checkpoint_falls_back_and_finishes_bit_equal(runs, tmp_path, case):
    corrupt, resume_step, quarantined = CASES[case]
    root = tmp_path / "run"
    shutil.copytree(runs / "killed", root)
    checkpoints = run_dir(root) / "checkpoints"
    corrupt(checkpoints)

    rerun = run("resumable.py", root, *ARGS, LOSS_LOG=tmp_path / "rerun.jsonl")
    assert_ok(rerun)
    assert f"resuming from {checkpoints / STEP.format(resume_step)}" in rerun.stdout, rerun.stdout
    assert "CHECKPOINT" in rerun.stdout, "a repaired checkpoint problem must be reported loudly"
    if quarantined:
        moved = [p for p in (checkpoints / "quarantine").iterdir() if p.name.startswith(quarantined)]
        assert len(moved) == 1 and (moved[0] / "REASON.txt").read_text().strip()
    assert not list(checkpoints.glob(".tmp-*"))

    expected = read_losses(runs / "reference.jsonl")
    for position, loss in read_losses(tmp_path / "rerun.jsonl").items():
        assert expected[position] == loss, f"loss at {position} differs"
    assert_same_weights(final_weights(runs / "reference"), final_weights(root))
    assert (checkpoints / "latest").read_text().strip() == STEP.format(40)
