"""Launching TorchFT replica groups of tests/scripts/resumable.py, and reading what they recorded.

Each group is one process, or several ranks started as torchrun would start them (RANK, WORLD_SIZE, MASTER_PORT of
the group's own). Output goes to files (torchft is chatty: a pipe nobody reads would block a group).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tests import zygote
from tests.runs import PINNED_CODE, SCRIPTS, environment, free_port, run_dir

# Short enough for tests: a dead group is noticed after the lighthouse's heartbeat timeout (1 s in these tests).
FT_ARGS = ("--ft.enabled", "true", "--ft.group_size", "2", "--ft.timeout", "10", "--ft.quorum_timeout", "60")


class Group:
    """One launch of one replica group: a process per group-local rank and the file each one writes."""

    def __init__(self, replica: int, processes: list[subprocess.Popen], logs: list[Path]) -> None:
        self.replica, self.processes, self.logs = replica, processes, logs

    def running(self) -> bool:
        return any(process.poll() is None for process in self.processes)

    def wait(self, timeout: float = 180) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for process in self.processes:
            try:
                codes.append(process.wait(timeout=max(deadline - time.monotonic(), 1)))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"replica group {self.replica} did not end:\n{self.output()[-3000:]}") from None
        return codes

    def kill(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=30)

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs if log.exists())

    def assert_ok(self, timeout: float = 180) -> None:
        codes = self.wait(timeout)
        assert codes == [0] * len(codes), f"group {self.replica} exited {codes}:\n{self.output()[-4000:]}"


def launch(root: Path, lighthouse: str, replica: int, *args: str, ranks: int = 1, name: str = "", **env: Any) -> Group:
    """Start replica group `replica` of the run under workspace `root`; its output goes next to `root`."""
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *PINNED_CODE, *FT_ARGS]
    command += ["--ft.replica_id", str(replica), "--ft.lighthouse", lighthouse, *args]
    port = free_port()
    processes, logs = [], []
    for rank in range(ranks):
        log = root.parent / f"group{replica}{name}-rank{rank}.log"
        extra = dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=ranks, LOCAL_WORLD_SIZE=ranks, MASTER_PORT=port)
        process_env = environment(MASTER_ADDR="127.0.0.1", **(extra if ranks > 1 else {}), **env)
        with open(log, "w") as output:
            processes.append(zygote.popen(command, env=process_env, stdout=output, stderr=subprocess.STDOUT))
        logs.append(log)
    return Group(replica, processes, logs)


def wait_until(condition: Callable[[], bool], what: str, live: list[Group] = (), timeout: float = 120) -> None:
    """Poll `condition` until it holds; fail at once when a group of `live` ended meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        for group in live:
            assert group.running(), f"group {group.replica} ended before {what}:\n{group.output()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def sidecar(root: Path) -> dict[str, Any]:
    path = run_dir(root) / "sidecar.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def ft_record(root: Path, replica: int) -> dict[str, Any]:
    """`ft.replicas[<replica>]` of the run's sidecar ({} before the group wrote it)."""
    return (sidecar(root).get("ft") or {}).get("replicas", {}).get(str(replica), {})


def final_state(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two processes hold bit-identical parameters and optimizer state (Adam's moments and step included)."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"parameter {key} differs"
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    assert state_a.keys() == state_b.keys() and state_a, "optimizer states differ in their parameters (or are empty)"
    for index in state_a:
        for key in state_a[index]:
            assert torch.equal(state_a[index][key], state_b[index][key]), f"optimizer {index}.{key} differs"
