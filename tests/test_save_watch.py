"""A save that writes nothing for `ckpt.hang_warning_s` is named in the log (a hung filesystem otherwise stalls a run
without a word): the watch's own logic with stand-in measurements, a synchronous save whose write blocks, and a real
writer process stopped with SIGSTOP in the middle of a run, which then finishes once it is continued."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from perdure import CheckpointPolicy, FileCheckpointManager
from perdure.checkpoints.commit import read_pointer
from perdure.checkpoints.save_watch import SaveWatch, staged_bytes
from tests.runs import run_dir, start

pytestmark = pytest.mark.timeout(120)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_save_that_stages_nothing_is_named_again_at_doubling_intervals_and_its_end_is_told(tmp_path, caplog):
    staged = {"bytes": 0}
    watch = SaveWatch(tmp_path, 0.2, poll_s=0.02, measure=lambda root, name: staged["bytes"])
    with caplog.at_level(logging.WARNING, logger="perdure"):
        watch.begin("ckpt-s000000000010", "training waits for it")
        wait_until(lambda: len(watch.warnings) == 1)
        first = watch.warnings[0]
        assert "checkpoint ckpt-s000000000010 has written nothing for" in first
        assert "0 B staged so far" in first and f"{tmp_path}/.tmp-ckpt-s000000000010-*" in first
        assert "the filesystem may be hung or overloaded; training waits for it" in first
        wait_until(lambda: len(watch.warnings) == 2)  # again after 2 x 0.2 s more, not at every poll
        staged["bytes"] = 4096  # it writes again: quiet for a while
        time.sleep(0.3)
        assert len(watch.warnings) == 2
        watch.end("ckpt-s000000000010")
    assert "checkpoint ckpt-s000000000010: the write ended after" in caplog.text


def test_a_save_that_keeps_writing_is_never_named(tmp_path):
    staged = {"bytes": 0}

    def growing(root, name):
        staged["bytes"] += 1
        return staged["bytes"]

    watch = SaveWatch(tmp_path, 0.1, poll_s=0.02, measure=growing)
    watch.begin("ckpt-s000000000010", "training waits for it")
    time.sleep(0.5)
    watch.end("ckpt-s000000000010")
    assert watch.warnings == [] and staged["bytes"] > 5


def test_a_filesystem_that_does_not_answer_a_stat_is_named_all_the_same(tmp_path):
    release = threading.Event()

    def hung(root, name):  # a stat on a hung NFS mount blocks
        release.wait(30)
        return 0

    watch = SaveWatch(tmp_path, 0.2, poll_s=0.02, deadline_s=0.1, measure=hung)
    watch.begin("ckpt-s000000000020", "training waits for it")
    wait_until(lambda: watch.warnings)
    assert "the filesystem did not answer a stat within 0s" in watch.warnings[0]
    release.set()
    watch.end("ckpt-s000000000020")


def test_staged_bytes_count_the_files_of_that_save_only_and_follow_no_symlink(tmp_path):
    staging = tmp_path / ".tmp-ckpt-s000000000010-123-abcd"
    (staging / "shards").mkdir(parents=True)
    (staging / "state.pth").write_bytes(b"x" * 100)
    (staging / "shards" / "rank00001.pth").write_bytes(b"x" * 20)
    outside = tmp_path / "big.bin"
    outside.write_bytes(b"x" * 5000)
    (staging / "link.pth").symlink_to(outside)
    (tmp_path / ".tmp-ckpt-s000000000100-123-abcd").mkdir()
    (tmp_path / ".tmp-ckpt-s000000000100-123-abcd" / "state.pth").write_bytes(b"x" * 7)
    assert staged_bytes(tmp_path, "ckpt-s000000000010") == 120 + len(str(outside))  # the link's own size
    assert staged_bytes(tmp_path, "ckpt-s000000000100") == 7


class BlockingManager(FileCheckpointManager):
    """Its write blocks until released, as on a hung filesystem."""

    release = threading.Event()

    def write(self, staging, replicated, local):
        self.release.wait(60)
        return super().write(staging, replicated, local)


class Saved:
    def state_dict(self):
        return {"step": 3}

    def load_state_dict(self, state):
        raise AssertionError("only saved")


def test_a_synchronous_save_whose_write_blocks_is_named_with_the_training_waiting(tmp_path, caplog):
    manager = BlockingManager(tmp_path / "checkpoints", CheckpointPolicy(hang_warning_s=0.3))
    manager.watch.poll_s = 0.02
    saving = threading.Thread(target=manager.save, args=("ckpt-s000000000003", {"state": Saved()}, {}),
                              kwargs={"meta": {"global_step": 3}})  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="perdure"):
        saving.start()
        wait_until(lambda: manager.watch.warnings)
        assert "training waits for it (a synchronous save)" in manager.watch.warnings[0]
        BlockingManager.release.set()
        saving.join(30)
    assert read_pointer(tmp_path / "checkpoints", "latest") == "ckpt-s000000000003"
    assert "checkpoint ckpt-s000000000003: the write ended after" in caplog.text


def writer_processes(pid: int) -> list[int]:
    """The processes `pid` started with multiprocessing's spawn (its checkpoint writer)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if int(fields[1]) == pid and b"spawn_main" in command:
                found.append(int(entry.name))
    return found


def test_a_stopped_writer_process_is_named_in_the_log_and_the_run_ends_once_it_goes_on(tmp_path):
    """SIGSTOP freezes the writer process as a hung filesystem freezes its write: the saves queue behind it, the log
    names the one under way, the final save waits for it; SIGCONT lets everything finish and commit."""
    args = ("--steps", "40", "--ckpt.interval", "10", "--ckpt.async_mode", "process", "--ckpt.hang_warning_s", "1")
    process = start("resumable.py", tmp_path, *args, STEP_SLEEP="0.05")
    try:
        wait_until(lambda: writer_processes(process.pid) or process.poll() is not None, timeout=60)
        assert process.poll() is None, process.communicate()[0]
        writers = writer_processes(process.pid)
        for writer in writers:
            os.kill(writer, signal.SIGSTOP)
        logs = lambda: "".join(path.read_text() for path in tmp_path.glob("*/*/logs/*.log"))  # noqa: E731
        wait_until(lambda: "has written nothing for" in logs(), timeout=60)
        assert "training goes on while it is written in the background" in logs()
        assert process.poll() is None, "the run ended with its writer stopped"
        for writer in writers:
            os.kill(writer, signal.SIGCONT)
        output, _ = process.communicate(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output
    assert "the write ended after" in output
    checkpoints = run_dir(tmp_path) / "checkpoints"
    assert read_pointer(checkpoints, "latest") == "ckpt-s000000000040"
