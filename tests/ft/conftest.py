"""One lighthouse per test module, started with `perdure ft lighthouse` (which is what it tests too)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests import zygote
from tests.runs import environment

# A group silent for 1 s is left out of the next quorum; a forming quorum waits 0.3 s for groups not yet joined.
LIGHTHOUSE_ARGS = ("--heartbeat-timeout-ms", "1000", "--join-timeout-ms", "300")


def start_lighthouse(*args: str) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "perdure.cli.main", "ft", "lighthouse", "--bind", "127.0.0.1:0", *args]
    process = zygote.popen(command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    assert line.startswith("lighthouse listening on http://127.0.0.1:"), f"lighthouse said {line!r}"
    return process, line.split()[3]


def stop_lighthouse(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGTERM)
    rest, _ = process.communicate(timeout=30)
    return rest


@pytest.fixture(scope="module")
def lighthouse():
    """The address of a lighthouse shared by the module's tests (min replicas 1)."""
    process, address = start_lighthouse(*LIGHTHOUSE_ARGS)
    try:
        yield address
    finally:
        rest = stop_lighthouse(process)
        assert process.returncode == 0 and "lighthouse stopped" in rest, rest
