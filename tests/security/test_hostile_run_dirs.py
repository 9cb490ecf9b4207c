"""Issue 16, items 2 to 4: a run never escapes its directory or the workspace root, media.jsonl drives no deletion
outside what the media logger wrote, and no write follows a symlink someone left in a run directory."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest
import yaml

from perdure import ConfigError, PerdureError
from perdure.checkpoints.commit import read_pointer
from tests import zygote
from tests.runs import SCRIPTS, environment
from tests.scripts.resumable import Config, ResumableRunner, make_config
from tests.security.hostile import (
    TINY,
    latest,
    perdure_cli,
    rewrite_manifest,
    run_dir_of,
    snapshot,
    text,
)

pytestmark = pytest.mark.timeout(120)


def resume_in_process(root: Path, **settings) -> ResumableRunner:
    """The victim's training, continued in this process to step 6 (or `steps`)."""
    runner = ResumableRunner(make_config(root, **{**TINY, "steps": 6, **settings}))
    runner.train()
    return runner


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory outside the workspace with a file in it: what an attacker's symlinks point at."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "secret.txt").write_text("the user's own file\n")
    return directory


# ---- item 2: ids and lineages are single path components ----------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("workspace.id", "../../escaped"),
        ("workspace.id", "ABSOLUTE"),
        ("workspace.lineage", ".."),
        ("workspace.lineage", "a/../../b"),
    ],
)
def test_a_run_never_escapes_the_workspace_root(tmp_path, key, value):
    root = tmp_path / "workspace" / "runs"
    value = str(tmp_path / "absolute-run") if value == "ABSOLUTE" else value
    before = snapshot(tmp_path)
    argv = ["--workspace.root", str(root), "--steps", "4", f"--{key}", value]
    with pytest.raises(ConfigError) as error:
        ResumableRunner(Config().parse(argv, exit_on_error=False))
    assert error.value.key == key
    assert snapshot(tmp_path) == before  # nothing created, inside or outside the root


def test_a_shared_yaml_cannot_move_the_run_out_of_the_root_given_on_the_command_line(tmp_path):
    shared = tmp_path / "shared.yaml"
    shared.write_text(yaml.safe_dump({"workspace": {"id": "../../../escaped"}, "steps": 4}))
    before = snapshot(tmp_path)
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--config", str(shared), "--workspace.root"]
    result = zygote.run([*command, str(tmp_path / "runs")], env=environment(), capture_output=True, timeout=60)
    assert result.returncode == 2
    assert "error: config key 'workspace.id' = '../../../escaped'" in text(result) and "Traceback" not in text(result)
    assert snapshot(tmp_path) == before


def test_a_checkpoints_stored_config_cannot_move_from_checkpoint_out_of_the_root(file_root, tmp_path):
    checkpoint = latest(run_dir_of(file_root))
    stored = yaml.safe_load((checkpoint / "config.yaml").read_text())
    stored["workspace"]["id"] = "../../../../escaped"
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(stored))
    rewrite_manifest(checkpoint)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as error:
        ResumableRunner.from_checkpoint(checkpoint, Config)
    assert error.value.key == "workspace.id"
    assert snapshot(tmp_path) == before


# ---- item 3: media.jsonl never drives a deletion of anything the media logger did not write -----------------------


def test_media_index_lines_delete_nothing_but_media(file_root, outside):
    run = run_dir_of(file_root)
    targets = ["checkpoints/ckpt-s000000000004/state.pth", "metadata/config.full.yaml", "run.lock", "sidecar.json"]
    lines = [{"step": 999, "tag": "x", "index": 0, "shape": [1, 1, 1], "path": target} for target in targets]
    lines.append({"step": 999, "tag": "../..", "index": 0, "path": "../outside/secret.txt"})
    (outside / "x").mkdir()
    (outside / "x" / "00000999_0.png").write_bytes(b"not ours")
    (run / "media").symlink_to(outside)  # `media/x/00000999_0.png` is exactly the name the logger would use
    lines.append({"step": 999, "tag": "x", "index": 0, "path": "media/x/00000999_0.png"})
    (run / "media.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    before = snapshot(outside)
    checkpoint_files = {k: v for k, v in snapshot(run / "checkpoints").items() if k.startswith("ckpt-")}

    resume_in_process(file_root)  # drops every line after step 4: their files would have been deleted

    assert all((run / target).exists() for target in targets)
    assert snapshot(outside) == before
    assert checkpoint_files.items() <= snapshot(run / "checkpoints").items()  # every checkpoint file still there


# ---- item 4: no write follows a symlink ------------------------------------------------------------------------------


def test_a_symlinked_run_lock_is_refused_and_its_target_untouched(file_root, outside):
    run = run_dir_of(file_root)
    (run / "run.lock").unlink()
    (run / "run.lock").symlink_to(outside / "secret.txt")
    before = snapshot(outside)
    with pytest.raises(PerdureError, match="run.lock is a symlink"):
        resume_in_process(file_root)
    assert snapshot(outside) == before


@pytest.mark.parametrize("name", ["heartbeat", "sidecar.json", "metrics.csv"])
def test_a_symlinked_run_file_is_moved_aside_and_its_target_untouched(file_root, outside, name):
    run = run_dir_of(file_root)
    (run / name).unlink()
    (run / name).symlink_to(outside / "secret.txt")
    before = snapshot(outside)
    resume_in_process(file_root)
    assert snapshot(outside) == before
    assert (run / name).is_file() and not (run / name).is_symlink()  # perdure's own file, written anew
    assert [path for path in run.iterdir() if path.name.startswith(name + ".") and path.is_symlink()]  # kept aside


def test_a_dangling_metrics_csv_symlink_creates_nothing_outside(file_root, outside):
    run = run_dir_of(file_root)
    (run / "metrics.csv").unlink()
    (run / "metrics.csv").symlink_to(outside / "created-by-perdure.csv")
    before = snapshot(outside)
    resume_in_process(file_root)
    assert snapshot(outside) == before


def test_a_symlinked_logs_dir_is_refused(file_root, outside):
    run = run_dir_of(file_root)
    shutil.rmtree(run / "logs")
    (run / "logs").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    with pytest.raises(PerdureError, match="logs is a symlink"):
        resume_in_process(file_root)
    assert snapshot(outside) == before


@pytest.mark.parametrize("name", ["ckpt-s000000000009", ".tmp-ckpt-s000000000005-123-abcd"])
def test_a_symlinked_checkpoint_or_staging_dir_is_never_written_into(file_root, outside, name):
    run = run_dir_of(file_root)
    (run / "checkpoints" / name).symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    runner = resume_in_process(file_root)
    assert snapshot(outside) == before  # no REASON.txt, nothing moved there
    assert runner.restore_source.info.name == "ckpt-s000000000004"


def test_a_symlinked_quarantine_dir_never_receives_a_checkpoint(file_root, outside):
    run = run_dir_of(file_root)
    checkpoints = run / "checkpoints"
    (checkpoints / "quarantine").symlink_to(outside, target_is_directory=True)
    state = checkpoints / "ckpt-s000000000004" / "state.pth"
    state.write_bytes(state.read_bytes()[:100])  # corrupt: the resume would quarantine it
    before = snapshot(outside)
    runner = resume_in_process(file_root)
    assert snapshot(outside) == before
    assert (checkpoints / "ckpt-s000000000004" / "state.pth").exists()  # left in place, not moved outside
    assert runner.restore_source.info.name == "ckpt-s000000000002"


def test_a_symlinked_registry_db_is_never_written_through(file_root, tmp_path):
    other = tmp_path / "someone-elses.db"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE runs (name TEXT)")
        db.execute("INSERT INTO runs VALUES ('precious')")
    db.close()
    (file_root / "registry.db").symlink_to(other)
    before = other.read_bytes()
    result = perdure_cli("runs", "ls", "--root", file_root)
    assert result.returncode == 0 and "victim" in text(result)
    assert other.read_bytes() == before
    assert not Path(str(other) + "-journal").exists()


def test_pointers_written_by_a_resume_replace_a_symlink_never_its_target(file_root, outside):
    checkpoints = run_dir_of(file_root) / "checkpoints"
    (checkpoints / "latest").unlink()
    (checkpoints / "latest").symlink_to(outside / "secret.txt")
    before = snapshot(outside)
    resume_in_process(file_root)
    assert snapshot(outside) == before
    assert read_pointer(checkpoints, "latest") == "ckpt-s000000000006" and not os.path.islink(checkpoints / "latest")
