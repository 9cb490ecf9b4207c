"""Issue 16, item 8: prune deletes only checkpoints and its own leftovers and is never wedged by a symlink; a pointer
never echoes a file; a NUL or over-long name, a `run.lock` directory and a lock held by another program get clear
messages (no traceback, never a stale pid or `kill 1`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.scripts.resumable import Config, ResumableRunner, make_config
from tests.security.hostile import TINY, perdure_cli, perdure_cli_each, resume, run_dir_of, snapshot, text

pytestmark = pytest.mark.timeout(120)


def resume_in_process(root: Path, **settings) -> ResumableRunner:
    runner = ResumableRunner(make_config(root, **{**TINY, "steps": 6, **settings}))
    runner.train()
    return runner


def test_prune_never_deletes_a_users_prune_named_folder(file_root, tmp_path):
    checkpoints = run_dir_of(file_root) / "checkpoints"
    notes = checkpoints / ".prune-notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine too")
    (checkpoints / ".prune-elsewhere").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)

    result = perdure_cli("ckpt", "prune", run_dir_of(file_root), "--keep", "1")
    assert result.returncode == 0, text(result)
    assert "removed ckpt-s000000000002" in text(result) and "left .prune-notes: not perdure's" in text(result)
    resume_in_process(file_root, **{"ckpt.keep_latest_k": 1})  # the run's own retention, too

    assert (notes / "todo.txt").read_text() == "mine"
    assert snapshot(outside) == before and (checkpoints / ".prune-elsewhere").is_symlink()
    assert not (checkpoints / "ckpt-s000000000002").exists() and (checkpoints / "ckpt-s000000000006").is_dir()


def test_a_checkpoint_symlink_neither_wedges_prune_nor_fails_training(file_root, tmp_path, capsys):
    checkpoints = run_dir_of(file_root) / "checkpoints"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"someone's data")
    (checkpoints / "ckpt-s000000000001").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)

    resume_in_process(file_root, **{"ckpt.keep_latest_k": 1})  # saves 6 and prunes 2 (4 is where it resumed from)
    resume_in_process(file_root, **{"ckpt.keep_latest_k": 1, "steps": 8})  # saves 8, prunes 4 and 6

    output = capsys.readouterr().out
    assert "partial directory was removed" not in output and "failed" not in output and "could not" not in output
    kept = sorted(p.name for p in checkpoints.glob("ckpt-*") if not p.is_symlink())
    assert "ckpt-s000000000002" not in kept and kept[-1] == "ckpt-s000000000008" and len(kept) <= 3  # pruned
    assert (checkpoints / "ckpt-s000000000001").is_symlink() and snapshot(outside) == before
    assert not list(checkpoints.glob(".prune-*"))


def test_a_latest_symlink_never_echoes_the_file_it_points_to(file_root, tmp_path):
    secret = tmp_path / "credentials"
    secret.write_text("aws_secret_access_key = TOKEN-1234-SECRET\n" * 10)
    checkpoints = run_dir_of(file_root) / "checkpoints"
    (checkpoints / "latest").unlink()
    (checkpoints / "latest").symlink_to(secret)
    codes, output = perdure_cli_each(("ckpt", "ls", checkpoints), ("ckpt", "verify", checkpoints))
    assert codes == [0, 1] and b"SECRET" not in output and b"is a symlink" in output
    result = resume(file_root)
    assert result.returncode == 0 and "SECRET" not in text(result)
    assert not any("SECRET" in log.read_text() for log in (checkpoints.parent / "logs").iterdir())


@pytest.mark.parametrize(
    ("option", "value"),
    [("workspace.id", "a\0b"), ("workspace.lineage", "y" * 4000), ("checkpoint", "/tmp/a\0b")],
    ids=["nul-id", "long-lineage", "nul-checkpoint"],
)
def test_a_nul_or_over_long_name_in_a_config_file_is_a_clear_config_error(tmp_path, capsys, option, value):
    config = tmp_path / "given.yaml"  # argv cannot carry a NUL; a config file can
    section, _, key = option.rpartition(".")
    config.write_text(json.dumps({section: {key: value}} if section else {key: value}))
    with pytest.raises(SystemExit) as stop:  # what the training script's Config().parse() does for its user
        ResumableRunner(Config().parse(["--steps", "4", "--config", str(config), "--workspace.root", str(tmp_path)]))
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: config key '{option}'")
    assert list(tmp_path.iterdir()) == [config]


def test_an_over_long_run_id_on_the_command_line_is_a_clear_error(tmp_path):
    result = resume(tmp_path / "runs", "--workspace.id", "x" * 300)
    assert result.returncode == 2
    assert "error: config key 'workspace.id' = 'xxxxxxxx" in text(result) and "at most 128 bytes" in text(result)
    assert "Traceback" not in text(result) and not (tmp_path / "runs").exists()


def test_a_run_lock_directory_is_a_clear_error(file_root):
    run = run_dir_of(file_root)
    (run / "run.lock").unlink()
    (run / "run.lock").mkdir()
    result = resume(file_root)
    assert result.returncode != 0
    assert "run.lock is a directory, not perdure's lock file; move it away" in text(result)
    assert "Traceback" not in text(result)


def test_a_lock_held_by_another_program_names_that_program_not_the_stale_note(file_root):
    run = run_dir_of(file_root)
    stale = {"pid": 1, "host": socket.gethostname(), "started": "long ago", "argv": "python old.py"}
    (run / "run.lock").write_text(json.dumps(stale))
    holder = subprocess.Popen(["flock", str(run / "run.lock"), "sleep", "60"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while str(holder.pid) not in Path("/proc/locks").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        result = resume(file_root)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # flock and the sleep it started, which holds the lock too
        holder.wait()
    output = text(result)
    assert result.returncode != 0 and "Traceback" not in output
    assert f"in use by pid {holder.pid} on {socket.gethostname()} (flock {run / 'run.lock'} sleep 60)" in output
    assert not re.search(r"pid 1\b|kill 1\b", output) and "old.py" not in output
