"""A DCP checkpoint process killed while it starts, seen by torch before the kernel let it be reaped: torch reports
`Exit code: None`; the run's message still names the signal (perdure/checkpoints/dcp_process.py)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from perdure.checkpoints.dcp_process import _start_failed
from perdure.errors import CheckpointStateError


@pytest.mark.timeout(60)
def test_a_starting_process_killed_before_torch_could_read_its_exit_code_is_named_killed():
    process = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(60,))  # as torch starts its own
    process.start()
    try:
        os.kill(process.pid, signal.SIGKILL)
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # dead, and not reaped: torch's moment
        error = _start_failed(RuntimeError("Checkpoint background process is dead. Exit code: None"), rank=1)
    finally:
        process.kill()
        process.join(10)
    assert isinstance(error, CheckpointStateError)
    assert "DCP's checkpoint process of rank 1 was killed by SIGKILL" in str(error)
    assert "while it was starting" in str(error) and "Run it again" in str(error)


def test_a_starting_process_that_failed_on_its_own_says_how():
    error = _start_failed(RuntimeError("Checkpoint background process is dead. Exit code: 3"), rank=0)
    assert "DCP's checkpoint process of rank 0 failed (RuntimeError: Checkpoint background process is dead. " in str(
        error
    )
