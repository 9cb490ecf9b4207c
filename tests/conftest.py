"""Test order for `make test` (pytest-xdist, --dist worksteal): the files whose tests each run for tens of seconds
(clusters, sweeps, faults, several ranks) come first, so that the last tests the two workers run are short ones and
neither waits alone for a minute-long test at the end. Within a file the order is unchanged."""

from __future__ import annotations

import pytest

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
