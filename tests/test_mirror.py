"""Checkpoints mirrored to object storage (`ckpt.mirror`), against a real S3 server on loopback (tests/s3_store.py):
a run SIGKILLed during an upload continues from the mirror on an empty disk bit for bit, a corrupt object is skipped,
`ckpt.keep_latest_k` prunes the mirror, and a store that goes down does not stop training."""

from __future__ import annotations

import logging
import shutil
import signal
import time

import pytest
import torch

from perdure import ConfigError, RunnerConfig
from perdure.checkpoints.commit import checkpoint_name, commit_checkpoint, make_staging_dir, write_file
from perdure.checkpoints.mirror import MirrorStore, upload_checkpoint
from perdure.checkpoints.mirror_restore import restore_newest
from perdure.cli import main as cli
from perdure.workspace.sidecar import SIDECAR_NAME, read_sidecar
from tests.runs import assert_ok, assert_same_weights, built_once, final_weights, run, run_dir, start
from tests.s3_store import S3Store

# ~1.5 MB checkpoints every 2 steps: an upload is nearly always under way while the run trains.
ARGS = ("--steps", "20", "--ckpt.interval", "2", "--width", "256", "--depth", "2")


@pytest.fixture
def s3_store():
    store = S3Store()
    yield store
    store.stop()


def reference(tmp_path_factory):
    return built_once(tmp_path_factory, "mirror-reference", lambda root: assert_ok(run("resumable.py", root, *ARGS)))


def test_sigkill_during_upload_then_empty_disk_resumes_from_mirror(tmp_path, tmp_path_factory, s3_store):
    root = tmp_path / "run"
    process = start("resumable.py", root, *ARGS, "--ckpt.mirror", s3_store.url, STEP_SLEEP="0.03", **s3_store.env)
    deadline = time.monotonic() + 120
    # Files go up in name order, manifest last: a checkpoint with objects but no state.pth yet (the largest) is caught
    # with that upload and the manifest's still to come, not in a race with the manifest's.
    while not (s3_store.complete() and any("state.pth" not in files for files in s3_store.checkpoints().values())):
        assert process.poll() is None, f"the run ended before an upload was caught half-way:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, "no upload was caught half-way"
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL
    complete, partial = s3_store.complete(), s3_store.partial()
    assert partial and partial[-1] > complete[-1], (complete, partial)

    shutil.rmtree(root)  # the requeued job lands on a machine whose disk is empty
    rerun = run("resumable.py", root, *ARGS, "--ckpt.mirror", s3_store.url, **s3_store.env)
    assert_ok(rerun)
    assert f"{partial[-1]} is no checkpoint (no manifest.json object" in rerun.stdout
    assert f"{complete[-1]} fetched from the mirror" in rerun.stdout
    assert f"resuming from {run_dir(root)}/checkpoints/{complete[-1]}" in rerun.stdout
    assert_same_weights(final_weights(reference(tmp_path_factory)), final_weights(root))
    assert s3_store.complete()[-1] == "ckpt-s000000000020" and not s3_store.partial()


def test_keep_latest_k_and_a_flipped_byte_in_the_mirror(tmp_path, tmp_path_factory, s3_store, capsys, monkeypatch):
    root = tmp_path / "run"
    mirror = ("--ckpt.mirror", s3_store.url, "--ckpt.keep_latest_k", "2")
    assert_ok(run("resumable.py", root, *mirror, *ARGS, **s3_store.env))
    assert s3_store.pointer("latest") == "ckpt-s000000000020"
    protected = {s3_store.pointer("best")}  # never pruned, however old
    complete = s3_store.complete()  # a checkpoint still waiting when a newer one committed was never uploaded
    newest, older = complete[-1], complete[-2]
    assert newest == "ckpt-s000000000020" and set(complete) == {older, newest} | protected, complete
    assert not s3_store.partial()

    key = s3_store.key_of(newest, "state.pth")
    data = bytearray(s3_store.get(key))
    data[len(data) // 2] ^= 0x01
    s3_store.put(key, bytes(data))
    for name, value in s3_store.env.items():
        monkeypatch.setenv(name, value)
    run_url = f"{s3_store.url}/{run_dir(root).relative_to(root).as_posix()}"
    assert cli.main(["ckpt", "verify", run_url]) == 1
    assert f"FAILED  {run_url}/checkpoints/{newest}: state.pth: checksum mismatch" in capsys.readouterr().out

    shutil.rmtree(root)
    rerun = run("resumable.py", root, *mirror, *ARGS, **s3_store.env)
    assert_ok(rerun)
    assert f"{newest} failed verification (state.pth: checksum mismatch)" in rerun.stdout
    assert f"resuming from {run_dir(root)}/checkpoints/{older}" in rerun.stdout
    assert_same_weights(final_weights(reference(tmp_path_factory)), final_weights(root))

    # the rerun uploaded its own ckpt-s000000000020 again: the mirror verifies, and exports what training ended with
    assert cli.main(["ckpt", "verify", run_url]) == 0
    assert cli.main(["ckpt", "export", f"{run_url}/checkpoints/latest", str(tmp_path / "out.pth")]) == 0
    assert_same_weights(torch.load(tmp_path / "out.pth", weights_only=True), final_weights(root))
    assert cli.main(["ckpt", "prune", run_url, "--keep", "1"]) == 0
    assert set(s3_store.complete()) == {newest, s3_store.pointer("best")}


def test_store_down_during_training(tmp_path, s3_store):
    root = tmp_path / "run"
    # Steps are slow (STEP_SLEEP) while `slow` exists: the run cannot end before the store is back, however late the
    # first upload completes on a loaded machine (200 slow steps: 30 s); once the store is back they run at full speed.
    slow = tmp_path / "slow"
    slow.touch()
    # async saves: the writer thread hands each commit to the uploader
    args = ("--steps", "200", "--ckpt.interval", "2", "--ckpt.async_mode", "thread", "--ckpt.mirror", s3_store.url)
    process = start("resumable.py", root, *args, STEP_SLEEP="0.15", SLOW_WHILE=str(slow), **s3_store.env)
    deadline = time.monotonic() + 120

    def running(what: str) -> None:
        if process.poll() is None and time.monotonic() < deadline:
            return
        process.kill()
        output, _ = process.communicate(timeout=60)
        raise AssertionError(f"{what} (exit {process.returncode}):\n{output[-6000:]}")

    while not s3_store.complete():
        running("nothing was uploaded")
        time.sleep(0.05)
    s3_store.stop()
    down = time.monotonic()
    before = len(list(root.glob("*/*/checkpoints/ckpt-s*")))
    # Down for longer than the client's own retries (s3fs: ~2 s): the uploader warns and backs off.
    while time.monotonic() < down + 4 or len(list(root.glob("*/*/checkpoints/ckpt-s*"))) < before + 3:
        running("training stopped while the store was down")
        time.sleep(0.05)
    s3_store.restart()
    slow.unlink()
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "retrying in" in output and "training goes on" in output, output
    failures = read_sidecar(run_dir(root) / SIDECAR_NAME)["attempts"][-1]["save_failures"]
    assert failures and all("mirror: upload failed, retrying" in failure["error"] for failure in failures), failures
    assert s3_store.complete()[-1] == "ckpt-s000000000200"
    assert s3_store.pointer("latest") == "ckpt-s000000000200"


def test_a_hostile_or_damaged_mirror_is_never_used(tmp_path, s3_store, monkeypatch, caplog):
    for name, value in s3_store.env.items():
        monkeypatch.setenv(name, value)
    local = tmp_path / "made" / "checkpoints"
    for step in (1, 2, 3):
        staging = make_staging_dir(local, checkpoint_name(step=step))
        record = write_file(staging / "state.pth", lambda file, step=step: file.write(bytes([step]) * 1000))
        commit_checkpoint(staging, local / checkpoint_name(step=step), {"state.pth": record}, {"global_step": step})
    store = MirrorStore(f"{s3_store.url}/run/checkpoints")
    for step in (1, 2, 3):
        upload_checkpoint(store, local, checkpoint_name(step=step))
    # step 3's object grew (bytes appended after the manifest's size); step 2's manifest names a file outside it
    key = s3_store.key_of("ckpt-s000000000003", "state.pth")
    s3_store.put(key, s3_store.get(key) + b"x")
    key = s3_store.key_of("ckpt-s000000000002", "manifest.json")
    s3_store.put(key, s3_store.get(key).replace(b'"state.pth"', b'"../../escape"'))
    config = RunnerConfig()
    config.steps, config.ckpt.mirror = 1, "team-bucket/prefix"
    with pytest.raises(ConfigError, match="'ckpt.mirror' = 'team-bucket/prefix': use an object-store URL"):
        config.check()

    root = tmp_path / "new-machine" / "checkpoints"
    caplog.set_level(logging.WARNING, logger="perdure")
    assert restore_newest(store, root) == "ckpt-s000000000001"
    assert "ckpt-s000000000003 failed verification (state.pth: size 1001 != 1000 in manifest)" in caplog.text
    assert "ckpt-s000000000002 is no checkpoint (manifest.json has a malformed entry for '../../escape')" in caplog.text
    assert sorted(path.name for path in root.iterdir()) == ["ckpt-s000000000001", "latest"]
    assert (root / "ckpt-s000000000001" / "state.pth").read_bytes() == bytes([1]) * 1000
    assert not (tmp_path / "escape").exists() and not (tmp_path / "new-machine" / "escape").exists()

    # back on a machine whose disk holds an older checkpoint than the mirror: the mirror's newer one is taken
    staging = make_staging_dir(local, checkpoint_name(step=4))
    record = write_file(staging / "state.pth", lambda file: file.write(bytes([4]) * 1000))
    commit_checkpoint(staging, local / checkpoint_name(step=4), {"state.pth": record}, {"global_step": 4})
    upload_checkpoint(store, local, checkpoint_name(step=4))
    assert restore_newest(store, root, (4, "ckpt-s000000000004")) is None  # not newer: nothing fetched
    assert restore_newest(store, root, (1, "ckpt-s000000000001")) == "ckpt-s000000000004"
    assert "newer than ckpt-s000000000001 on this disk: ckpt-s000000000004 fetched from the mirror" in caplog.text
    s3_store.stop()  # a store that is down: the local checkpoint is used, with a warning
    assert restore_newest(store, root, (4, "ckpt-s000000000004")) is None
    assert "could not be read" in caplog.text and "continuing from ckpt-s000000000004 on this disk" in caplog.text
