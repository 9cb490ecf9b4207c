"""Helpers for tests that launch training programs in subprocesses and compare their runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).parent.parent


def environment(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("PERDURE_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)})
    env.update({key: str(value) for key, value in extra.items()})
    return env


def run(script: str, root: Path, *args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    """Run a training script to completion with `workspace.root = root`."""
    command = [sys.executable, str(SCRIPTS / script), "--workspace.root", str(root), *args]
    return subprocess.run(command, env=environment(**env), capture_output=True, text=True, timeout=timeout)


def run_until_killed(
    script: str, root: Path, *args: str, when_exists: str, delay: float = 0.0, timeout: float = 240, **env: str
) -> subprocess.CompletedProcess:
    """Start a run, wait until `root/<glob when_exists>` exists, wait `delay` more, then SIGKILL it."""
    command = [sys.executable, str(SCRIPTS / script), "--workspace.root", str(root), *args]
    process = subprocess.Popen(
        command, env=environment(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + timeout
    while not list(root.glob(when_exists)):
        if process.poll() is not None:
            raise AssertionError(f"run ended before {when_exists} appeared:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"{when_exists} never appeared")
        time.sleep(0.01)
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate(timeout=60)
    return subprocess.CompletedProcess(command, process.returncode, output, "")


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


def final_weights(root: Path, name: str = "model.pth") -> dict[str, torch.Tensor]:
    return torch.load(run_dir(root) / name, weights_only=True)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"parameter {key} differs"


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
