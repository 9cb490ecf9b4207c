"""Helpers for the sweep tests: matrices, the `perdure sweep` command in a subprocess, waiting on the state."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from perdure.sweep.state import SweepState, read_state
from tests import zygote
from tests.runs import SCRIPTS, environment

PERDURE = [sys.executable, "-m", "perdure.cli.main"]


def write_matrix(path: Path, command: list[str], **sections: Any) -> Path:
    path.write_text(yaml.safe_dump({"command": command, **sections}, sort_keys=False))
    return path


def training_command(root: Path, *args: str) -> list[str]:
    """tests/scripts/sweep_job.py with its workspace under `root`."""
    return [sys.executable, str(SCRIPTS / "sweep_job.py"), "--workspace.root", str(root), *args]


def training_sweep(tmp: Path, *, steps: int, step_sleep: float, seeds: list[int], env: dict | None = None) -> Path:
    """`tmp/sweep`: sweep_job.py jobs over `seeds` (workspace `tmp/runs`, losses in `tmp/losses/<job>.jsonl`)."""
    (tmp / "losses").mkdir()
    matrix = write_matrix(
        tmp / "m.yaml",
        training_command(tmp / "runs", "--steps", str(steps), "--log.interval", "5"),
        grid={"seed": seeds},
        env={"STEP_SLEEP": str(step_sleep), "LOSS_LOG": str(tmp / "losses" / "{job}.jsonl")},
    )
    result = sweep("init", str(tmp / "sweep"), str(matrix), env=env)
    assert result.returncode == 0, result.stderr
    return tmp / "sweep"


def echo_command() -> list[str]:
    return [sys.executable, str(SCRIPTS / "sweep_echo.py")]


def sweep(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `perdure sweep ARGS` to completion (stdout and stderr kept apart)."""
    return zygote.run(
        [*PERDURE, "sweep", *args], env=env or environment(), capture_output=True, text=True, timeout=timeout
    )


def start_sweep(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `perdure sweep ARGS` (a dispatcher) in the background, output merged."""
    return zygote.popen(
        [*PERDURE, "sweep", *args],
        env=env or environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        raise AssertionError(f"dispatcher did not finish in {timeout} s:\n{output}") from None
    return process.returncode, output


def wait_for(predicate: Callable[[], Any], timeout: float = 120, what: str = "condition", poll: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def rows(sweep_dir: Path) -> dict[str, Any]:
    """The sweep's rows by job id (read without the lock, like `status`)."""
    return {row.id: row for row in read_state(sweep_dir).jobs}


def state(sweep_dir: Path) -> SweepState:
    return read_state(sweep_dir)


def sidecar(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "sidecar.json").read_text())


def status_json(sweep_dir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    result = sweep("status", str(sweep_dir), "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
