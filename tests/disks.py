"""Real small or read-only disks for fault tests: a tmpfs, or an ext4 image on a loop device, mounted under the test's
directory (needs CAP_SYS_ADMIN; a test skips, saying so, where the machine does not grant it)."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import pytest


def mount_or_skip(path: Path, options: str) -> None:
    """Mount a tmpfs with `options` (e.g. "size=600k", "ro", "nr_inodes=1") at `path`, created here; skip the test
    where the machine refuses."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting a small tmpfs needs CAP_SYS_ADMIN, which this machine does not grant")


def mount_ext4_or_skip(path: Path, megabytes: int) -> None:
    """Mount a fresh ext4 filesystem of `megabytes` (an image file beside `path`, on a loop device) at `path`; skip the
    test where the machine has no mkfs.ext4 or refuses the mount."""
    image = path.with_name(path.name + ".img")
    with open(image, "wb") as file:
        file.truncate(megabytes << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 cannot make a filesystem here: {made.stderr.decode(errors='replace').strip()}")
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("mounting an ext4 image needs CAP_SYS_ADMIN and a loop device, which this machine does not grant")


def unmount(path: Path) -> None:
    """Unmount it, lazily: a file a failed test left open must not keep the mount (and the test's directory) busy."""
    subprocess.run(["umount", "--lazy", str(path)], check=False)


def fill(path: Path) -> None:
    """Write zeros to `path` until its disk is full (ENOSPC): what another job on a shared disk does to a run."""
    with open(path, "wb", buffering=0) as file:
        for size in (1 << 16, 1 << 12, 1):  # then the pages, then the bytes left in the last one
            try:
                while True:
                    file.write(bytes(size))
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
