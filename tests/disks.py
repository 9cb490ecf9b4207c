"""Real small or read-only disks for fault tests: a tmpfs mounted under the test's directory (needs CAP_SYS_ADMIN;
a test skips, saying so, where the machine does not grant it)."""

from __future__ import annotations

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


def unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], check=False)
