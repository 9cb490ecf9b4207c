"""Issue 32, item 3: TorchFT's ports listen on loopback unless asked, so torchft's dashboard (which stops any group
with a plain POST, no authentication) and a group's manager, store and state server are not open to the network.

The real `perdure ft lighthouse` and a real replica group are started; what each process listens on is read from
/proc (its sockets, matched with the kernel's table of listening TCP sockets).
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time

import pytest

from tests import zygote
from tests.runs import environment

pytest.importorskip("torchft", reason="the ft extra is not installed (pip install 'perdure[ft]')")
pytestmark = pytest.mark.timeout(120)

LOOPBACK_V4, LOOPBACK_V6 = "0100007F", "00000000000000000000000001000000"  # /proc/net/tcp{,6} spelling


def listening(pid: int) -> list[tuple[str, int]]:
    """(address as /proc spells it, port) of every TCP socket process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.append((address, int(port, 16)))
    return found


def lighthouse(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "perdure.cli.main", "ft", "lighthouse", *args]
    return zygote.popen(command, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop(process: subprocess.Popen) -> tuple[str, str]:
    process.send_signal(signal.SIGTERM)
    return process.communicate(timeout=30)


def test_the_lighthouse_listens_on_loopback_by_default():
    process = lighthouse()
    try:
        line = process.stdout.readline()
        if "cannot start a lighthouse" in line or process.poll() is not None:
            pytest.skip(f"the default port 29510 is taken on this machine: {line or process.stderr.read()}")
        assert line.startswith("lighthouse listening on http://127.0.0.1:29510"), line
        assert listening(process.pid) == [(LOOPBACK_V4, 29510)]
    finally:
        _, errors = stop(process)
    assert "warning" not in errors


def test_another_interface_only_when_asked_and_with_a_warning():
    process = lighthouse("--bind", "0.0.0.0:0")
    try:
        line = process.stdout.readline()
        assert line.startswith("lighthouse listening on"), line
        ((address, _),) = listening(process.pid)
        assert address == "00000000"
    finally:
        _, errors = stop(process)
    assert "warning: the lighthouse listens on 0.0.0.0:0, not on loopback" in errors
    assert "stop any of them" in errors and "/kill" in errors


def test_a_group_on_loopback_listens_on_loopback_only(tmp_path):
    from tests.ft.conftest import LIGHTHOUSE_ARGS, start_lighthouse, stop_lighthouse
    from tests.ft.groups import launch, wait_until

    server, address = start_lighthouse(*LIGHTHOUSE_ARGS)
    group = launch(tmp_path / "runs", address, 0, "--steps", "2000", "--ft.group_size", "1", STEP_SLEEP="0.05")
    try:
        log = group.logs[0]
        wait_until(lambda: log.exists() and "quorum of 1 group(s)" in log.read_text(errors="replace"),
                   "the group's first quorum", [group])  # fmt: skip
        time.sleep(1)  # its first healing offer: the state server is up
        ports = listening(group.processes[0].pid)
    finally:
        group.kill()
        stop_lighthouse(server)
    assert len(ports) >= 3, ports  # the manager, the store, the state server a healing group downloads from
    assert all(address in (LOOPBACK_V4, LOOPBACK_V6) for address, _ in ports), ports


@pytest.mark.skipif(platform.machine() != "x86_64", reason="calls tgkill by its x86-64 system call number")
def test_a_sigterm_that_lands_on_a_torchft_thread_still_stops_the_lighthouse():
    """The kernel hands a signal sent to the process to any of its threads; one of the Rust server's threads is
    chosen here on purpose (tgkill), as scancel's SIGTERM sometimes is. The lighthouse must stop all the same."""
    import ctypes

    process = lighthouse("--bind", "127.0.0.1:0")
    try:
        line = process.stdout.readline()
        assert line.startswith("lighthouse listening on"), line
        threads = [int(tid) for tid in os.listdir(f"/proc/{process.pid}/task") if int(tid) != process.pid]
        assert threads, "torchft's server runs threads of its own"
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.syscall(234, process.pid, threads[0], signal.SIGTERM) == 0  # 234: tgkill on x86-64
        output, errors = process.communicate(timeout=20)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0 and "lighthouse stopped" in output, (output, errors)
