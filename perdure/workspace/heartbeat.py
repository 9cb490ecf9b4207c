"""`heartbeat`: the step a live run reached, kept exact without a system call per step, and its mtime as proof of life.

The runner records every optimizer step in it, so that a run killed without a word (SIGKILL, the OOM killer) still says
how far it got: the next attempt counts the steps it must train again (`steps_lost`). A write per step cost 15-20 us
of a 1 ms step on ext4 (the kernel updates the mtime, journals the inode, and runs cold after the step's kernels:
`benchmarks/step_overhead.py`), so on a filesystem that rewrites a file's page in place the step is stored into a
shared mapping of the file instead: the page cache holds it, and a killed process leaves it to be written back like any
write. The mtime then moves when the kernel writes the page back and at each `touch` (the runner's telemetry touches it
every few seconds), which is all a reader needs of it: the registry calls a run `stale` after minutes of silence.

Only ext2/3/4, XFS and tmpfs are mapped. A store into a mapped page the kernel cannot keep (a copy-on-write filesystem
such as btrfs or ZFS, or Lustre, needing a new block on a full disk or past a quota) is a SIGBUS that kills the
process, where a failed write is a warning; those overwrite in place a block the first write allocated. Everywhere else
the step is written with `pwrite`, as before. Nothing but the runner may truncate the file of a live run.
"""

from __future__ import annotations

import logging
import mmap
import os
from pathlib import Path

from perdure.safe_io import UnsafeFileError, move_aside, open_writable, read_regular

HEARTBEAT_NAME = "heartbeat"
RECORD_BYTES = 21  # the step right-aligned in 20 digits, and a newline
IN_PLACE_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "tmpfs"})
MOUNTINFO_LIMIT = 16 << 20  # bytes of /proc/self/mountinfo read at most (hosts with thousands of mounts)

logger = logging.getLogger("perdure")


def touch_heartbeat(run_dir: Path) -> None:
    """Set the mtime of `run_dir/heartbeat` to now (creating it): proof the run was alive at this moment."""
    fd = _open_heartbeat(Path(run_dir) / HEARTBEAT_NAME)
    try:
        os.utime(fd)
    finally:
        os.close(fd)


def _open_heartbeat(path: Path, *, readable: bool = False) -> int:
    """The heartbeat file for writing, created if missing, never through a symlink: a symlink (or anything but a
    regular file) there is moved aside with a warning first."""
    try:
        return open_writable(path, readable=readable)
    except UnsafeFileError as error:
        aside = move_aside(path, "unexpected")
        logger.warning("%s; moved it to %s (its target is untouched) and started a new heartbeat", error, aside.name)
        return open_writable(path, readable=readable)


def _record(step: int) -> bytes:
    return f"{int(step):>20}\n".encode()


class Heartbeat:
    """The live run's heartbeat: `beat(step)` records how far training got, `touch(step)` also moves the mtime now.

    `beat` is a store into the file's mapped page where the filesystem allows it (module docstring), else a `pwrite`;
    either way a killed process leaves the exact step. `start_attempt` reads it to count the steps an interruption
    cost. A write that fails (a full disk: the first write needs a block) is a warning, once, never an error: the
    heartbeat only describes the training.
    """

    def __init__(self, run_dir: Path, step: int) -> None:
        self.path = Path(run_dir) / HEARTBEAT_NAME
        self._fd = _open_heartbeat(self.path, readable=True)
        self._failed = False
        self._page: mmap.mmap | None = None
        if self._write(_record(step)) and filesystem_type(self._fd) in IN_PLACE_FILESYSTEMS:
            try:  # the write above gave the page its block: stores into it need none
                self._page = mmap.mmap(self._fd, RECORD_BYTES, flags=mmap.MAP_SHARED)
            except OSError as error:  # a filesystem that maps no file for writing: write each step instead
                logger.debug("heartbeat %s is written, not mapped: %s", self.path, error)

    @property
    def mapped(self) -> bool:
        """Whether `beat` stores into a mapped page (no system call) rather than writing."""
        return self._page is not None

    def beat(self, step: int) -> None:
        """Record `step` (after every optimizer step)."""
        if self._page is not None:
            self._page[:RECORD_BYTES] = _record(step)
        else:
            self._write(_record(step))

    def touch(self, step: int) -> None:
        """Record `step` with a write, which moves the mtime now (every few seconds, and at the end of the attempt)."""
        self._write(_record(step))

    def _write(self, record: bytes) -> bool:
        try:
            os.pwrite(self._fd, record, 0)
        except OSError as error:
            if not self._failed:
                logger.warning("could not write %s (%s); training goes on", self.path, error)
            self._failed = True
            return False
        return True

    def close(self) -> None:
        if self._page is not None:
            self._page.close()
            self._page = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def filesystem_type(fd: int) -> str | None:
    """The type of the filesystem holding the open file `fd`, as `/proc/self/mountinfo` names it (`ext4`, `nfs4`,
    `lustre`, ...), found by the file's device; None when unknown (no /proc, a device no mount lists: btrfs
    subvolumes report devices of their own)."""
    device = os.fstat(fd).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        text = read_regular("/proc/self/mountinfo", MOUNTINFO_LIMIT, follow_symlinks=True).decode("utf-8", "replace")
    except (OSError, UnsafeFileError):
        return None
    for line in text.splitlines():
        # "36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw": the device is the third field, the type
        # the first after the lone "-" that ends the optional fields
        fields = line.split(" ")
        if len(fields) > 2 and fields[2] == wanted and "-" in fields[6:]:
            rest = fields[fields.index("-", 6) + 1 :]
            return rest[0] if rest else None
    return None


def heartbeat_step(run_dir: Path) -> int | None:
    """The step the heartbeat last recorded, or None (no heartbeat, or one that only marks time)."""
    try:
        return int(read_regular(Path(run_dir) / HEARTBEAT_NAME, 64).decode("ascii").strip())
    except (OSError, ValueError):
        return None


def heartbeat_mtime(run_dir: Path) -> float | None:
    """The mtime of `run_dir/heartbeat`, or None if there is none."""
    try:
        return (Path(run_dir) / HEARTBEAT_NAME).stat().st_mtime
    except OSError:
        return None
