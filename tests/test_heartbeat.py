"""The heartbeat keeps the exact step a killed process reached, with a store into a mapped page where the filesystem
rewrites pages in place (no system call per step) and a write elsewhere; a full disk never turns a beat into a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from perdure.workspace import heartbeat as heartbeat_module
from perdure.workspace.heartbeat import HEARTBEAT_NAME, Heartbeat, filesystem_type, heartbeat_mtime, heartbeat_step
from tests.disks import mount_ext4_or_skip, mount_or_skip, unmount

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent

# A process that beats steps 1..STEPS, makes its page clean (written back, write-protected) when asked, fills the disk
# when asked, beats once more and is then SIGKILLed by itself: what it leaves in the file is what the next attempt
# reads.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from perdure.workspace.heartbeat import Heartbeat
    from tests.disks import fill
    run_dir, steps, then_fill = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    heartbeat = Heartbeat(run_dir, 0)
    print("mapped" if heartbeat.mapped else "written", flush=True)
    for step in range(1, steps + 1):
        heartbeat.beat(step)
    if then_fill:
        os.fsync(heartbeat._fd)  # the page is written back: the next store faults and asks the filesystem again
        fill(Path(then_fill))
        heartbeat.beat(steps + 1)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def filesystem_of(path: Path) -> str | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return filesystem_type(fd)
    finally:
        os.close(fd)


def killed_child(run_dir: Path, steps: int, then_fill: Path | None = None) -> tuple[str, int]:
    """Run CHILD; its first line and its exit status (the negative signal that ended it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(run_dir), str(steps), str(then_fill or "")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,  # the child imports tests.disks
    )
    return result.stdout.strip(), result.returncode


def test_a_killed_process_leaves_its_exact_step_from_a_mapped_page(tmp_path):
    kind = filesystem_of(tmp_path)
    if kind not in heartbeat_module.IN_PLACE_FILESYSTEMS:
        pytest.skip(f"the test directory is on {kind}, which the heartbeat does not map")
    how, status = killed_child(tmp_path / "run", 12345)
    assert how == "mapped" and status == -signal.SIGKILL
    assert heartbeat_step(tmp_path / "run") == 12345
    assert (tmp_path / "run" / HEARTBEAT_NAME).read_bytes() == b"12345".rjust(20) + b"\n"


def test_elsewhere_each_beat_is_a_write(tmp_path, monkeypatch):
    """A filesystem not known to rewrite in place (btrfs, ZFS, Lustre, NFS, FUSE...): no mapping, a pwrite per beat."""
    monkeypatch.setattr(heartbeat_module, "filesystem_type", lambda fd: "btrfs")
    heartbeat = Heartbeat(tmp_path, 7)
    try:
        assert not heartbeat.mapped and heartbeat_step(tmp_path) == 7
        heartbeat.beat(8)
        assert heartbeat_step(tmp_path) == 8
    finally:
        heartbeat.close()


def test_a_mapped_beat_is_read_at_once_and_touch_moves_the_mtime(tmp_path):
    heartbeat = Heartbeat(tmp_path, 3)
    try:
        if not heartbeat.mapped:
            pytest.skip(f"the test directory is on {filesystem_type(heartbeat._fd)}, which the heartbeat does not map")
        heartbeat.beat(41)
        assert heartbeat_step(tmp_path) == 41  # another reader sees the store through the page cache
        os.utime(tmp_path / HEARTBEAT_NAME, (1_000, 1_000))
        heartbeat.touch(42)
        assert heartbeat_step(tmp_path) == 42
        mtime = heartbeat_mtime(tmp_path)
        assert mtime is not None and mtime > time.time() - 60
    finally:
        heartbeat.close()


def test_a_resumed_attempt_overwrites_the_last_step_in_place(tmp_path):
    """The file holds the last attempt's step; the next one starts from its own (fixed width: nothing is left over)."""
    (tmp_path / HEARTBEAT_NAME).write_bytes(b"123456789".rjust(20) + b"\n")
    heartbeat = Heartbeat(tmp_path, 5)
    try:
        assert heartbeat_step(tmp_path) == 5
    finally:
        heartbeat.close()


@pytest.mark.parametrize("disk", ["ext4", "tmpfs"])
def test_a_disk_that_fills_up_leaves_the_mapped_beat_working(tmp_path, disk):
    """The page's block was allocated by the first write: once the disk is full, a store into the page (after the
    kernel wrote it back, so the store faults and asks the filesystem) still needs nothing, and no SIGBUS kills the
    process. The killed process's last step is there."""
    mount = tmp_path / "disk"
    if disk == "ext4":
        mount_ext4_or_skip(mount, 8)
    else:
        mount_or_skip(mount, "size=1m")
    try:
        assert filesystem_of(mount) == disk
        how, status = killed_child(mount / "run", 100, then_fill=mount / "other-job")
        assert how == "mapped"
        assert status == -signal.SIGKILL, f"the child ended with {status}, not by its own SIGKILL (a SIGBUS is -7)"
        assert heartbeat_step(mount / "run") == 101
        with pytest.raises(OSError, match="No space left"), open(mount / "more", "wb", buffering=0) as more:
            more.write(bytes(4096))  # the disk was full indeed
    finally:
        unmount(mount)


def test_filesystem_type_names_this_machine_s_filesystems(tmp_path):
    assert filesystem_of(tmp_path)  # whatever it is, the mount table lists it
    if Path("/dev/shm").is_dir():
        assert filesystem_of(Path("/dev/shm")) == "tmpfs"
