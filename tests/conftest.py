"""Test order for `make test` (pytest-xdist, --dist worksteal): the files whose tests each run for tens of seconds
(clusters, sweeps, faults, several ranks) come first, so that the last tests the two workers run are short ones and
neither waits alone for a minute-long test at the end. Within a file the order is unchanged.

Where the tests write: under /dev/shm when it is a tmpfs with room (`pytest_configure`), else pytest's default.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SHARED_MEMORY = Path("/dev/shm")
ROOM_NEEDED = 6 << 30  # what a whole `make test` writes stays under 2 GiB; the ranks' own shared memory goes there too

SLOW_FIRST = (
    "tests/test_sweep_slurm.py",
    "tests/test_sweep.py",
    "tests/faults/",
    "tests/parallel/",
    "tests/test_examples.py",
    "tests/deepspeed/",
    "tests/ft/",
    "tests/distributed/",
    "tests/test_state_dict_hooks.py",
    "tests/test_resume.py",
)


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::", 1)[0]
    return next((rank for rank, prefix in enumerate(SLOW_FIRST) if path.startswith(prefix)), len(SLOW_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: every worker collects the same order


def pytest_configure(config: pytest.Config) -> None:
    """Runs, checkpoints and logs the tests write go to /dev/shm when it is a tmpfs with room, unless `--basetemp` says
    otherwise. Every save fsyncs its files and directories and every retired checkpoint is unlinked: on this project's
    disks (a virtual disk that discards on unlink) that was a third of a two-rank DCP launch, and two workers' fsyncs
    queue behind each other. tmpfs keeps every other behaviour a test checks (atomic renames, pointers, kills in the
    middle of a write: a SIGKILL loses what a process did not write, not what the disk did not sync). The directory is
    one folder per running session (by pid), removed by the next session once its pytest has ended."""
    if config.option.basetemp or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # set by the user; or a pytest-xdist worker, which gets its own folder inside the controller's
    try:
        stats = os.statvfs(SHARED_MEMORY)
        mounted = {line.split()[1]: line.split()[2] for line in Path("/proc/mounts").read_text().splitlines()}
    except OSError:
        return
    if mounted.get(str(SHARED_MEMORY)) != "tmpfs" or stats.f_bavail * stats.f_frsize < ROOM_NEEDED:
        return
    sessions = SHARED_MEMORY / f"perdure-tests-{os.getuid()}"
    sessions.mkdir(mode=0o700, exist_ok=True)
    for earlier in sessions.iterdir():  # one folder per session, named by its pid: sessions may run side by side
        if earlier.name.isdigit() and not Path(f"/proc/{earlier.name}").exists():
            shutil.rmtree(earlier, ignore_errors=True)
    config.option.basetemp = str(sessions / str(os.getpid()))
