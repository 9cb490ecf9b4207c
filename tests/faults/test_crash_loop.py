"""A program that fails at the same step under every launch: once `resilience.max_attempts_without_progress` attempts
in a row ended without a new checkpoint, the next launch exits 93 before building anything and the run is `stuck`; a
sweep never requeues that exit; a larger limit or `perdure sweep retry` lets the run try again."""

from __future__ import annotations

import sys

import pytest

from perdure.cli.main import main as perdure_cli
from perdure.registry import Registry
from perdure.resilience.crash_loop import attempts_without_progress
from perdure.workspace.sidecar import read_sidecar
from tests.runs import LAUNCH_DEFAULTS, SCRIPTS, run, run_dir, run_ranks
from tests.sweeps import rows, sweep, write_matrix

pytestmark = pytest.mark.timeout(300)

ARGS = ("--steps", "30", "--ckpt.interval", "10", "--resilience.max_attempts_without_progress", "2")
BUG = {"RAISE_AT_STEP": "15"}  # fails every attempt at step 15, after the checkpoint of step 10


def attempts(root):
    return read_sidecar(run_dir(root) / "sidecar.json")["attempts"]


def test_a_crash_loop_exits_93_and_the_run_is_stuck(tmp_path, capsys):
    failed = [run("resumable.py", tmp_path, *ARGS, **BUG) for _ in range(3)]
    assert [result.returncode for result in failed] == [1, 1, 1], failed[-1].stderr
    # the first attempt committed step 10 (progress); the next two started from it and committed nothing beyond
    assert [attempt["resumed_step"] for attempt in attempts(tmp_path)] == [0, 10, 10]

    stuck = run("resumable.py", tmp_path, *ARGS, **BUG)
    assert stuck.returncode == 93, stuck.stdout + stuck.stderr
    assert "is stuck: 2 attempts in a row ended without a checkpoint beyond step 10" in stuck.stdout
    assert stuck.stdout.count("failed at step 15: RuntimeError: boom at step 15") == 2
    assert "exiting 93 (do not requeue)" in stuck.stdout and "resuming from" not in stuck.stdout  # nothing built
    sidecar = read_sidecar(run_dir(tmp_path) / "sidecar.json")
    assert sidecar["status"] == "stuck" and len(sidecar["attempts"]) == 3  # the refused launch is no attempt
    assert len(list((run_dir(tmp_path) / "logs").iterdir())) == 3

    with Registry(tmp_path) as registry:
        assert [record.status for record in registry.runs()] == ["stuck"]
    capsys.readouterr()
    assert perdure_cli(["runs", "ls", "--root", str(tmp_path), "--status", "stuck"]) == 0
    assert run_dir(tmp_path).name in capsys.readouterr().out
    assert perdure_cli(["runs", "show", run_dir(tmp_path).name, "--root", str(tmp_path)]) == 0
    assert "stuck (2 attempts in a row ended without a checkpoint beyond step 10" in capsys.readouterr().out

    # a larger limit: one more attempt (which fails the same way), then refused again
    larger = (*ARGS, "--resilience.max_attempts_without_progress", "3")
    again = run("resumable.py", tmp_path, *larger, **BUG)
    assert again.returncode == 1 and "boom at step 15" in again.stderr
    assert run("resumable.py", tmp_path, *larger, **BUG).returncode == 93
    # the bug fixed, the same command trains on from step 10 and completes
    fixed = run("resumable.py", tmp_path, *larger, "--resilience.max_attempts_without_progress", "4")
    assert fixed.returncode == 0 and "resuming from" in fixed.stdout
    assert read_sidecar(run_dir(tmp_path) / "sidecar.json")["status"] == "completed"


def test_a_sweep_never_requeues_a_stuck_job_and_retry_lets_it_try_again(tmp_path):
    runs = tmp_path / "runs"
    for _ in range(3):  # the same command by hand first: the first commits step 10, the next two fail at once
        assert run("resumable.py", runs, *ARGS, **BUG).returncode == 1
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(runs)]
    matrix = write_matrix(tmp_path / "m.yaml", [*command, *LAUNCH_DEFAULTS, *ARGS], jobs=[{}], env=BUG)
    assert sweep("init", str(tmp_path / "sw"), str(matrix)).returncode == 0
    result = sweep("run", str(tmp_path / "sw"), "--slots", "1", "--poll", "0.1", "--retries", "10", timeout=240)
    assert result.returncode == 1, result.stdout + result.stderr
    (row,) = rows(tmp_path / "sw").values()
    assert (row.state, row.attempts, row.exit_code) == ("failed", 1, 93), row  # not requeued despite --retries 10
    assert "not requeued" in row.note
    assert read_sidecar(run_dir(runs) / "sidecar.json")["status"] == "stuck"

    assert sweep("retry", str(tmp_path / "sw"), row.id).returncode == 0
    result = sweep("run", str(tmp_path / "sw"), "--slots", "1", "--poll", "0.1", timeout=240)
    (row,) = rows(tmp_path / "sw").values()
    assert (row.attempts, row.exit_code) == (2, 1), row  # the retry trained (and failed the same way)
    assert [attempt.get("retry") for attempt in attempts(runs)][-2:] == [None, True]
    # counted from the retry: one attempt without progress, so the next launch may still try
    assert run("resumable.py", runs, *ARGS, **BUG).returncode == 1
    assert run("resumable.py", runs, *ARGS, **BUG).returncode == 93


def test_every_rank_of_a_stuck_run_exits_93(tmp_path):
    args = ("--steps", "20", "--ckpt.interval", "10", "--resilience.max_attempts_without_progress", "1")
    failed = run_ranks(2, "resumable.py", tmp_path, *args, RAISE_AT_STEP="5")
    assert [result.returncode for result in failed] == [1, 1], failed[0].stdout
    stuck = run_ranks(2, "resumable.py", tmp_path, *args, RAISE_AT_STEP="5")
    assert [result.returncode for result in stuck] == [93, 93], stuck[0].stdout + stuck[1].stdout
    assert "is stuck: 1 attempt in a row ended without a checkpoint beyond the start" in stuck[0].stdout
    assert read_sidecar(run_dir(tmp_path) / "sidecar.json")["status"] == "stuck"


def test_what_counts_as_an_attempt_without_progress():
    def attempt(status, step, **extra):
        return {"status": status, "resumed_step": step, **extra}

    hung, killed, failed = attempt("hung", 10), attempt("interrupted", 10), attempt("failed", 10)
    # an attempt that started from an older checkpoint committed the one this launch resumes from: progress
    assert attempts_without_progress([attempt("failed", 0), hung, killed, failed], 10) == [hung, killed, failed]
    # a preemption saved where it stopped, a completed attempt reached its budget: the count starts after them
    assert attempts_without_progress([failed, attempt("preempted", 10), killed], 10) == [killed]
    assert attempts_without_progress([failed, attempt("completed", 10)], 10) == []
    # an attempt that never recorded its end (killed) counts; the first attempt of a retry is the last one counted
    running, retried = attempt("running", 10), attempt("failed", 10, retry=True)
    assert attempts_without_progress([failed, retried, running], 10) == [retried, running]
    assert attempts_without_progress([failed, failed], 20) == []  # this launch resumes from a newer checkpoint
