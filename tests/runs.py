"""Helpers for tests that launch training programs in subprocesses and compare their runs."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests import zygote

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parent.parent
# Test runs pin the code part of their run directory: a test that kills and reruns a program must find the same run
# even when the checkout is edited meanwhile (tests of the code identity itself use repositories of their own).
PINNED_CODE = ("--workspace.code_id", "tests")
# On a GPU a resumed run continues bit for bit only with deterministic kernels (docs/checkpoints.md; attention's
# backward is not otherwise): the programs these tests launch ask for them there, before their own arguments (which
# may say otherwise). On a CPU nothing is added.
GPU_DETERMINISM = ("--deterministic", "true") if torch.cuda.is_available() else ()
LAUNCH_DEFAULTS = (*PINNED_CODE, *GPU_DETERMINISM)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A directory that `build` fills once per test session, whichever pytest-xdist worker asks for it first.

    A module-scoped fixture runs once per worker that runs a test of the module, and the two workers often both do:
    a reference run or a killed run built this way is built once and read by both (it must not be written to after).
    A build that failed part-way is built again by the next test that asks."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # the session's directory, above each worker's own
    target = shared / f"built-{name}"
    with open(shared / f"built-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not (target / ".built").exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            build(target)
            (target / ".built").touch()
    return target


def environment(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a launched program: this process's (or `base`), without PERDURE_* variables, plus `extra`."""
    env = {
        key: value for key, value in (os.environ if base is None else base).items() if not key.startswith("PERDURE_")
    }
    # PYTHONFAULTHANDLER: a process that dies of a signal (SIGABRT, SIGSEGV) prints every thread's Python stack.
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "PYTHONFAULTHANDLER": "1"})
    env.update({key: str(value) for key, value in extra.items()})
    return env


def run(script: str, root: Path, *args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """Run a training script to completion with `workspace.root = root`."""
    command = [sys.executable, str(SCRIPTS / script), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *args]
    return zygote.run(command, env=environment(**env), capture_output=True, text=True, timeout=timeout)


def run_until_killed(
    script: str, root: Path, *args: str, when_exists: str, delay: float = 0.0, timeout: float = 240, **env: str
) -> subprocess.CompletedProcess:
    """Start a run, wait until `root/<glob when_exists>` exists, wait `delay` more, then SIGKILL it."""
    process = start(script, root, *args, **env)
    wait_for(process, root, when_exists, timeout)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


def start(script: str, root: Path, *args: str, **env: str) -> subprocess.Popen:
    """Start a training script with `workspace.root = root` (stdout and stderr together), without waiting for it."""
    command = [sys.executable, str(SCRIPTS / script), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *args]
    return zygote.popen(command, env=environment(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for(process: subprocess.Popen, root: Path, pattern: str, timeout: float = 240) -> None:
    """Wait until `root/<glob pattern>` exists while `process` runs (killed if it never does)."""
    deadline = time.monotonic() + timeout
    while not list(root.glob(pattern)):
        if process.poll() is not None:
            raise AssertionError(f"run ended before {pattern} appeared:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{pattern} never appeared")
        time.sleep(0.01)


def run_dir(root: Path) -> Path:
    """The one run directory under a workspace root."""
    found = [path.parent for path in root.glob("*/*/checkpoints")]
    assert len(found) == 1, f"expected one run under {root}, found {found}"
    return found[0]


def read_losses(path: Path) -> dict[tuple[int, int, int], str]:
    losses = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        losses[(record["epoch"], record["step"], record["micro"])] = record["loss"]
    return losses


def wait_for_lines(path: Path, count: int, processes: list[subprocess.Popen], timeout: float = 120) -> None:
    """Wait until `path` has `count` lines (e.g. a LOSS_LOG: so many micro-batches done) while every process runs."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and len(path.read_text().splitlines()) >= count):
        assert time.monotonic() < deadline, f"{path} never reached {count} lines"
        assert all(process.poll() is None for process in processes), "a rank ended early"
        time.sleep(0.01)


def epoch_samples(logs: Path, prefix: str, ranks: int, keep) -> tuple[list[int], set[int]]:
    """The samples of epoch 0 that SAMPLE_LOG recorded in `logs/<prefix>-<rank>.jsonl` at the steps `keep` accepts,
    and every step logged."""
    seen, steps = [], set()
    for rank in range(ranks):
        for line in (logs / f"{prefix}-{rank}.jsonl").read_text().splitlines():
            record = json.loads(line)
            steps.add(record["step"])
            if record["epoch"] == 0 and keep(record["step"]):
                seen.extend(record["samples"])
    return seen, steps


def final_weights(root: Path, name: str = "model.pth") -> dict[str, torch.Tensor]:
    return torch.load(run_dir(root) / name, weights_only=True)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-equal tensors under the same names; compared on the CPU, so a live model on a GPU meets a saved file."""
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key].cpu(), b[key].cpu()), f"parameter {key} differs"


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def assert_all_ok(results: list[subprocess.CompletedProcess]) -> None:
    """Every rank of a multi-rank launch exited 0; else every failed rank's output (the first failure is often a peer
    of the rank that caused it: "Connection closed by peer")."""
    failed = [
        f"rank {rank} exited {result.returncode}:\n{result.stdout}\n{result.stderr[-4000:]}"
        for rank, result in enumerate(results)
        if result.returncode != 0
    ]
    assert not failed, "\n".join(failed)


_PORTS_PER_WORKER = 2000
_port_cursor: list[int] = []  # this process's next port in its slice, offset from the slice's start


def free_port() -> int:
    """A free TCP port for a launch this test starts (a MASTER_PORT, a lighthouse, a server).

    Not `bind(0)`: that hands out a port from the kernel's ephemeral range, the same range every outgoing connection and
    every gloo pair socket takes its port from, so between this probe and the launch's bind another test's ranks may
    take it (CI saw EADDRINUSE, and a rerun whose ranks found another run's store on their port and hung). The ports
    come from below the ephemeral range, where only an explicit bind lands, and each pytest-xdist worker draws from its
    own slice in order, so two tests never hand out the same port."""
    import socket

    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    start = ephemeral_low - _PORTS_PER_WORKER * (worker + 1)
    assert start > 1024, f"the ephemeral range starts at {ephemeral_low}: no room below it for worker {worker}"
    if not _port_cursor:
        _port_cursor.append(os.getpid() % _PORTS_PER_WORKER)  # a new session does not start on the last one's ports
    for _ in range(_PORTS_PER_WORKER):
        port = start + _port_cursor[0]
        _port_cursor[0] = (_port_cursor[0] + 1) % _PORTS_PER_WORKER
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:  # taken, or still in TIME_WAIT from an earlier launch
                continue
            return port
    raise AssertionError(f"no free port in {start}..{start + _PORTS_PER_WORKER - 1}")


def skip_unless_ranks_fit(world_size: int) -> None:
    """Skip the calling test when CUDA is visible with fewer GPUs than ranks: a rank trains on the GPU its LOCAL_RANK
    names (NCCL cannot put two ranks on one GPU). Without CUDA, ranks share the CPU through gloo and always fit."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        pytest.skip(
            f"{world_size} ranks need {world_size} GPUs when CUDA is visible, this machine has "
            f"{torch.cuda.device_count()}; run with CUDA_VISIBLE_DEVICES= to test the ranks on the CPU with gloo"
        )


def start_ranks(
    world_size: int, script: str, root: Path, *args: str, port: int | None = None, **env: str
) -> list[subprocess.Popen]:
    """Start `world_size` ranks of a script the way torchrun would (RANK, WORLD_SIZE, MASTER_ADDR/PORT), each in
    its own process, so a test can signal, kill and read the exit status of each rank."""
    skip_unless_ranks_fit(world_size)
    port = port or free_port()
    processes = []
    for rank in range(world_size):
        rank_env = environment(
            RANK=rank,
            LOCAL_RANK=rank,
            WORLD_SIZE=world_size,
            LOCAL_WORLD_SIZE=world_size,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            **env,
        )
        command = [sys.executable, str(SCRIPTS / script), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *args]
        processes.append(
            zygote.popen(command, env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    return processes


def run_ranks(
    world_size: int, script: str, root: Path, *args: str, timeout: float = 240, **env: str
) -> list[subprocess.CompletedProcess]:
    """Run every rank to the end; one CompletedProcess per rank (stdout and stderr together)."""
    processes = start_ranks(world_size, script, root, *args, **env)
    results = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(process.args, process.returncode, output, ""))
    return results


# ---- peak resident memory, measured in the launched programs (issue 38) ----------------------------------------------
# A program measures how far its resident memory rose (`reset_peak` at the start of what it measures, then
# `write_rise`, into the file a knob names, "{rank}" replaced); the test reads each rank's (`read_rises`). Memory, not
# time: the figures hold on a loaded machine. A process forked from the test zygote starts with the zygote's pages and
# peak, hence the reset.


def memory(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, in bytes (/proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def reset_peak() -> int:
    """Reset this process's peak resident memory (VmHWM) to what it holds now, and return that: the start a rise is
    measured from."""
    Path("/proc/self/clear_refs").write_text("5")
    return memory("VmRSS")


def write_rise(template: str | os.PathLike[str], rank: int, start: int) -> None:
    """Write this process's peak resident memory over `start` (bytes) to `template` with "{rank}" replaced."""
    Path(str(template).replace("{rank}", str(rank))).write_text(str(memory("VmHWM") - start))


def read_rises(template: Path, ranks: int) -> list[int]:
    """What `write_rise` wrote for each of `ranks` ranks to `template` ("{rank}" replaced): bytes."""
    return [int(Path(str(template).replace("{rank}", str(rank))).read_text()) for rank in range(ranks)]
