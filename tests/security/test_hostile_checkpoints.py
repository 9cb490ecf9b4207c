"""Issue 16, item 1: no checkpoint can run code, whichever command loads it.

Each test hands perdure a real checkpoint whose pickle would create a marker file (its manifest recomputed, as an
attacker would) and runs the real command. The marker never appears; the error names the file and the global.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from perdure import CheckpointError
from tests.scripts.resumable import Config, ResumableRunner
from tests.security.hostile import (
    latest,
    perdure_cli,
    poison_dcp_entry,
    poison_dcp_metadata,
    poison_torch_file,
    resume,
    run_dir_of,
    text,
)

pytestmark = pytest.mark.timeout(120)


def assert_refused(output: str, file: Path | str, global_name: str = "builtins.eval") -> None:
    assert "refused to load" in output and str(file) in output and global_name in output, output
    assert "weights_only=False" not in output and "Traceback" not in output, output


@pytest.mark.parametrize(
    ("poison", "refused"),
    [(poison_dcp_metadata, "{checkpoint}/.metadata"), (poison_dcp_entry, "entry 'optimizer.param_groups.0.lr'")],
    ids=["metadata", "non-tensor-entry"],  # DCP's own planner reads non-tensor entries with weights_only=False
)
def test_resume_never_runs_dcp_metadata_or_entries(dcp_root, tmp_path, poison, refused):
    checkpoint, marker = latest(run_dir_of(dcp_root)), tmp_path / "PWNED"
    poison(checkpoint, marker)
    result = resume(dcp_root, "--ckpt.backend", "dcp")
    assert not marker.exists()
    assert result.returncode != 0
    assert_refused(text(result), refused.format(checkpoint=checkpoint))


def test_checkpoint_into_a_file_run_never_runs_dcp_metadata_and_says_which_reader(dcp_root, tmp_path):
    checkpoint, marker = latest(run_dir_of(dcp_root)), tmp_path / "PWNED"
    poison_dcp_metadata(checkpoint, marker)
    result = resume(dcp_root, "--workspace.id", "branch", "--ckpt.backend", "file", "--checkpoint", str(checkpoint))
    output = text(result)
    assert not marker.exists()
    assert "written by the dcp backend but this run saves with the file backend" in output
    assert_refused(output, checkpoint / ".metadata")


def test_pretrained_never_runs_dcp_metadata(dcp_root, tmp_path):
    checkpoint, marker = latest(run_dir_of(dcp_root)), tmp_path / "PWNED"
    poison_dcp_metadata(checkpoint, marker)
    result = resume(dcp_root, "--workspace.id", "other", "--pretrained", str(checkpoint))
    assert not marker.exists()
    assert result.returncode != 0
    assert_refused(text(result), checkpoint / ".metadata")
    assert not list(dcp_root.glob("*/other"))  # refused before anything was written


def test_from_checkpoint_never_runs_dcp_metadata(dcp_root, tmp_path):
    checkpoint, marker = latest(run_dir_of(dcp_root)), tmp_path / "PWNED"
    poison_dcp_metadata(checkpoint, marker)
    with pytest.raises(CheckpointError) as error:
        ResumableRunner.from_checkpoint(checkpoint, Config)
    assert not marker.exists()
    assert_refused(str(error.value), checkpoint / ".metadata")


def test_ckpt_export_never_runs_dcp_metadata(dcp_root, tmp_path):
    checkpoint, marker = latest(run_dir_of(dcp_root)), tmp_path / "PWNED"
    poison_dcp_metadata(checkpoint, marker)
    result = perdure_cli("ckpt", "export", checkpoint, tmp_path / "model.safetensors")
    assert not marker.exists()
    assert result.returncode == 2 and not (tmp_path / "model.safetensors").exists()
    assert_refused(text(result), checkpoint / ".metadata")


def test_a_blocked_pickle_in_a_file_checkpoint_is_a_clear_error(file_root, tmp_path):
    checkpoint, marker = latest(run_dir_of(file_root)), tmp_path / "PWNED"
    poison_torch_file(checkpoint / "state.pth", marker)
    result = resume(file_root)
    assert not marker.exists()
    assert result.returncode != 0
    assert_refused(text(result), checkpoint / "state.pth")  # never torch's advice to retry with weights_only=False


def test_a_genuine_dcp_checkpoint_still_resumes(dcp_root):
    result = resume(dcp_root, "--ckpt.backend", "dcp")
    assert result.returncode == 0, text(result)
    assert "resuming from" in text(result) and "ckpt-s000000000004" in text(result)
    assert (run_dir_of(dcp_root) / "checkpoints" / "ckpt-s000000000006").is_dir()
