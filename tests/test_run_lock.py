"""The run lock: a second live process fails at once naming the first; a killed holder never blocks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from perdure.errors import PerdureError
from perdure.resilience.run_lock import RunLock, RunLockedError
from tests import zygote

# Takes the lock, says so on stdout, then sleeps until killed. With FORK=1 it first forks a child that sleeps too.
HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from perdure.resilience.run_lock import RunLock
    lock = RunLock(sys.argv[1])
    lock.acquire()
    if os.environ.get("FORK") == "1":
        child = os.fork()
        if child == 0:
            print("child", os.getpid(), lock.held, flush=True)
            time.sleep(120)
            os._exit(0)
        time.sleep(0.2)
    print("held", os.getpid(), flush=True)
    time.sleep(120)
    """
)


def start_holder(run_dir: Path, **env: str) -> tuple[subprocess.Popen, list[str]]:
    """Start a process holding the lock of `run_dir`; return it and the lines it printed before it held the lock."""
    process = zygote.popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    lines = []
    while True:
        line = process.stdout.readline()
        assert line, f"holder exited early with {process.wait()}"
        lines.append(line.split())
        if line.startswith("held"):
            return process, lines


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL)
    process.wait()


@pytest.fixture
def holder(tmp_path):
    process, _ = start_holder(tmp_path / "run")
    yield process
    kill(process)


def test_second_process_fails_at_once_naming_the_holder(tmp_path, holder):
    started = time.monotonic()
    with pytest.raises(RunLockedError) as caught:
        RunLock(tmp_path / "run").acquire()
    assert time.monotonic() - started < 1.0
    error = caught.value
    assert error.pid == holder.pid and error.host == socket.gethostname()
    message = str(error)
    assert f"pid {holder.pid} on {socket.gethostname()}" in message
    assert str(tmp_path / "run") in message and "since" in message and "-c" in message
    assert isinstance(error, PerdureError)


def test_a_killed_holder_does_not_block(tmp_path, holder):
    kill(holder)
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    assert lock.held
    info = json.loads((tmp_path / "run" / "run.lock").read_text())
    assert info["pid"] == os.getpid() and info["host"] == socket.gethostname()
    assert set(info) == {"pid", "host", "started", "argv"}
    lock.release()
    assert (tmp_path / "run" / "run.lock").exists()  # never deleted


def test_two_locks_in_one_process_conflict(tmp_path):
    first, second = RunLock(tmp_path), RunLock(tmp_path)
    with first:
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            second.acquire()
        assert first.held and not second.held
        with pytest.raises(RunLockedError):
            first.acquire()  # not re-entrant
    assert not first.held


def test_flock_on_a_second_open_file_description_conflicts(tmp_path):
    """The kernel fact the lock relies on (Linux, local fs), independent of the in-process registry."""
    import fcntl

    path = tmp_path / "f"
    path.touch()
    a, b = os.open(path, os.O_RDWR), os.open(path, os.O_RDWR)
    try:
        fcntl.flock(a, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(b, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(a)
        os.close(b)


def test_release_then_reacquire(tmp_path):
    lock = RunLock(tmp_path / "a" / "b")  # creates the run dir
    for _ in range(3):
        lock.acquire()
        assert lock.held
        lock.release()
        lock.release()  # idempotent
        assert not lock.held
    assert (tmp_path / "a" / "b" / "run.lock").read_text() == ""  # a finished holder leaves no info behind
    with RunLock(tmp_path / "a" / "b") as other:
        assert other.held


def test_release_in_a_process_lets_another_take_it(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    lock.release()
    process, _ = start_holder(tmp_path)
    try:
        with pytest.raises(RunLockedError, match=f"pid {process.pid} "):
            lock.acquire()
    finally:
        kill(process)
    lock.acquire()
    lock.release()


def test_a_forked_child_does_not_keep_a_dead_parents_lock(tmp_path):
    process, lines = start_holder(tmp_path, FORK="1")
    child_pid, child_held = int(lines[0][1]), lines[0][2]
    assert child_held == "False"
    try:
        kill(process)
        os.kill(child_pid, 0)  # the child still lives ...
        with RunLock(tmp_path) as lock:  # ... and does not hold the lock
            assert lock.held
    finally:
        try:
            os.kill(child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_lock_in_a_fork_of_this_process(tmp_path):
    """A child forked while the lock is held neither holds it nor can release it for the parent."""
    with RunLock(tmp_path) as lock:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0 if not lock.held else 1
            lock.release()  # a no-op in the child: must not unlock the parent
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert lock.held
        probe = "import sys; from perdure.resilience.run_lock import RunLock; RunLock(sys.argv[1]).acquire()"
        other = zygote.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True)
        assert other.returncode != 0 and f"pid {os.getpid()} " in other.stderr


def test_acquire_with_a_timeout_waits_for_the_holder(tmp_path, holder):
    started = time.monotonic()
    with pytest.raises(RunLockedError):
        RunLock(tmp_path / "run").acquire(timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 2.0
    threading.Timer(0.5, kill, args=(holder,)).start()
    lock = RunLock(tmp_path / "run")
    lock.acquire(timeout=30)
    assert lock.held and holder.poll() is not None
    lock.release()
