"""A hung rank, the way a cluster delivers it: `kill -STOP` of one rank of a torchrun launch. The live rank names it
within `dist.step_timeout`, writes its stacks, records the attempt `hung` and exits 92, so torchrun ends the job long
before `dist.timeout`; the rerun resumes from the last checkpoint and ends bit-equal to an uninterrupted run. A slow
evaluation (not a step) never counts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perdure.errors import UnsafeFileError
from perdure.resilience.hang_watch import HUNG_EXIT_CODE, HangVerdict, HangWatch, find_hang
from perdure.resilience.rank_heartbeat import RankBeat
from perdure.runners.state import RunnerState
from tests import zygote
from tests.runs import (
    LAUNCH_DEFAULTS,
    SCRIPTS,
    assert_all_ok,
    assert_same_weights,
    environment,
    final_weights,
    run_dir,
    run_ranks,
    skip_unless_ranks_fit,
    start,
    start_ranks,
    wait_for,
)

ARGS = ("--steps", "60", "--ckpt.interval", "10", "--log.interval", "10")


def rank_pid(root: Path, rank: int, launcher: subprocess.Popen, timeout: float = 120) -> int:
    """The pid of the process torchrun started as `rank` of the launch writing into `root` (from /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if str(root) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    variables = (entry / "environ").read_bytes().split(b"\0")
                    if f"RANK={rank}".encode() in variables and b"TORCHELASTIC_RUN_ID" in b"".join(variables):
                        return int(entry.name)
            except (OSError, ValueError):
                continue
        assert launcher.poll() is None, launcher.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} of the launch into {root} never started")


def wait_for_checkpoint(root: Path, step: int, launcher: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not list(root.glob(f"*/*/checkpoints/ckpt-s{step:012d}")):
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in {root}"
        time.sleep(0.05)


def wait_for_training_phase(root: Path, rank: int, after: int, launcher: subprocess.Popen, timeout: float = 60) -> None:
    """Until `rank`'s heartbeat says it reads or trains a step after `after`. A rank stopped inside a save or an
    evaluation is left to the limits of those phases (dist.timeout, ckpt.hang_warning_s: docs/resilience.md); the
    checkpoint directory appears before every rank has left the save, so the test waits for the next step."""
    deadline = time.monotonic() + timeout
    while True:
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline, f"rank {rank} never trained past step {after}"
        path = run_dir(root) / "heartbeats" / f"rank-{rank}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {}
        if record.get("phase") in ("data_loading", "training_step") and record.get("step", 0) > after:
            return
        time.sleep(0.01)


@pytest.mark.timeout(420)
def test_a_stopped_rank_is_named_hung_and_the_rerun_ends_bit_equal(tmp_path):
    skip_unless_ranks_fit(2)
    root = tmp_path / "hung"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *ARGS]
    command += ["--dist.step_timeout", "10"]  # dist.timeout stays 600 s
    launcher = zygote.popen(
        command, env=environment(STEP_SLEEP="0.1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    stopped, reference = None, []
    try:
        stopped = rank_pid(root, 1, launcher)
        wait_for_checkpoint(root, 10, launcher)
        wait_for_training_phase(root, 1, 10, launcher)
        os.kill(stopped, signal.SIGSTOP)
        at = time.monotonic()
        # The uninterrupted run to compare with trains meanwhile: the stopped launch only waits.
        reference = start_ranks(2, "resumable.py", tmp_path / "reference", *ARGS)
        while launcher.poll() is None:
            assert time.monotonic() - at < 120, "the launch never ended"
            time.sleep(0.1)
        took = time.monotonic() - at
        output = launcher.stdout.read()
        finished = [process.communicate(timeout=240)[0] for process in reference]
    finally:
        for process in reference:
            if process.poll() is None:
                process.kill()
        if stopped is not None:  # torchrun SIGKILLs it; if it did not, the test must not leave it stopped
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(stopped, signum)
                except ProcessLookupError:
                    pass
        if launcher.poll() is None:
            launcher.kill()
    assert all(process.returncode == 0 for process in reference), finished
    assert took < 60, f"the launch took {took:.0f} s to end after rank 1 stopped:\n{output}"
    lines = [line for line in output.splitlines() if "rank 1 (" in line and " hung in " in line]
    assert len(lines) == 1, output
    assert f"pid {stopped})" in lines[0] and "dist.step_timeout 10 s" in lines[0] and "steps took" in lines[0]
    assert f"exitcode  : {HUNG_EXIT_CODE}" in output, output  # torchrun's summary: rank 0 exited 92 first
    run = run_dir(root)
    sidecar = json.loads((run / "sidecar.json").read_text())
    assert sidecar["status"] == "hung" and sidecar["attempts"][-1]["status"] == "hung", sidecar
    assert "rank 1 (" in sidecar["attempts"][-1]["exit_reason"]
    (hang,) = (run / "hangs").iterdir()
    stacks = (hang / "rank-0.txt").read_text()
    assert "Thread" in stacks and "_train_until" in stacks, stacks  # rank 0's main thread, waiting for rank 1
    assert not (hang / "rank-1.txt").exists()  # a stopped rank writes nothing

    rerun = run_ranks(2, "resumable.py", root, *ARGS)
    assert_all_ok(rerun)
    assert_same_weights(final_weights(root), final_weights(tmp_path / "reference"))
    sidecar = json.loads((run / "sidecar.json").read_text())
    assert sidecar["status"] == "completed" and sidecar["attempts"][-1]["resumed_step"] >= 10


@pytest.mark.timeout(180)
def test_an_evaluation_longer_than_the_limit_is_not_a_hang(tmp_path):
    """Each evaluation takes about 2.5 s, the limit is 1 s: evaluations (like saves) never count against it, and the
    steps around them are fast. A watch that counted them would stop the run at its first evaluation."""
    results = run_ranks(
        2, "resumable.py", tmp_path, "--steps", "20", "--ckpt.interval", "10", "--dist.step_timeout", "1",
        EVAL_SLEEP="0.5",
    )  # fmt: skip
    assert_all_ok(results)
    assert "finished at step 20" in results[0].stdout
    assert not any(" hung in " in result.stdout for result in results)


@pytest.mark.timeout(120)
def test_one_process_stuck_in_a_step_exits_hung_with_its_stacks(tmp_path):
    """A process that is alive but does not finish its step (here a step that sleeps 120 s; a deadlocked DataLoader
    worker or a hung read looks the same) names itself and exits 92 once the limit passes."""
    gate = tmp_path / "slow"
    process = start(
        "resumable.py", tmp_path, "--steps", "100000", "--ckpt.interval", "10", "--dist.step_timeout", "2",
        STEP_SLEEP="120", SLOW_WHILE=str(gate),
    )  # fmt: skip
    try:
        wait_for(process, tmp_path, "*/*/checkpoints/ckpt-s000000000010")
        gate.touch()
        at = time.monotonic()
        output, _ = process.communicate(timeout=60)
        took = time.monotonic() - at
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == HUNG_EXIT_CODE, output
    assert took < 15, f"{took:.0f} s"
    (line,) = [line for line in output.splitlines() if " hung in " in line]
    assert "rank 0 (" in line and "hung in training_step" in line and "its process is alive" in line, line
    run = run_dir(tmp_path)
    assert json.loads((run / "sidecar.json").read_text())["attempts"][-1]["status"] == "hung"
    (hang,) = (run / "hangs").iterdir()
    assert "in train_step" in (hang / "rank-0.txt").read_text()  # the frame it sleeps in


def beat(rank: int, phase: str, step: int, since: float, beat: float, armed: bool = True) -> RankBeat:
    return RankBeat("a", rank, "host", 100 + rank, phase, step, since, beat, armed)


def test_the_rank_furthest_behind_decides():
    now = 1000.0
    frozen_in_step = {0: beat(0, "training_step", 7, 980.0, now), 1: beat(1, "training_step", 7, 985.0, 985.0)}
    hang = find_hang(frozen_in_step, now=now, limit=10, stale_after=2)
    assert [b.rank for b in hang.named] == [1] and hang.frozen == (1,) and hang.seconds == 15.0
    # not yet: the step started when its last rank entered it, 9 s ago
    entered_late = {**frozen_in_step, 1: beat(1, "training_step", 7, 991.0, 991.0)}
    assert find_hang(entered_late, now=now, limit=10, stale_after=2) is None
    assert find_hang({0: beat(0, "training_step", 7, 991.0, now)}, now=now, limit=10, stale_after=2) is None
    # rank 1 is saving step 6 (its own limit): rank 0, waiting in step 7 for it, is not hung
    saving = {0: beat(0, "training_step", 7, 900.0, now), 1: beat(1, "checkpoint", 6, 900.0, now)}
    assert find_hang(saving, now=now, limit=10, stale_after=2) is None
    # a rank behind in data loading is named, alive or not
    loading = {0: beat(0, "training_step", 7, 900.0, now), 1: beat(1, "data_loading", 7, 950.0, now)}
    assert [b.rank for b in find_hang(loading, now=now, limit=10, stale_after=2).named] == [1]
    # the first step of an attempt (not armed) and a rank without a heartbeat of this attempt: dist.timeout's
    unarmed = {0: beat(0, "training_step", 1, 900.0, now, armed=False), 1: beat(1, "data_loading", 1, 900.0, now)}
    assert find_hang(unarmed, now=now, limit=10, stale_after=2) is None
    assert find_hang({0: beat(0, "training_step", 7, 900.0, now), 1: None}, now=now, limit=10, stale_after=2) is None


def test_a_heartbeat_record_round_trips_and_a_torn_one_reads_as_none():
    record = beat(3, "end_of_step", 12, 5.5, 6.25)
    assert RankBeat.decode(record.encode()) == record and len(record.encode()) == 512
    assert RankBeat.decode(record.encode()[:100]) is None
    assert RankBeat.decode(b'{"rank": 1}') is None


def test_the_watch_never_writes_through_a_symlink(tmp_path, caplog):
    """A run directory may come from someone else: a symlinked `heartbeats` turns the watch off for the attempt (a
    warning, training goes on) and a symlinked `hangs` is refused; nothing is written where they point."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / "heartbeats").symlink_to(elsewhere)
    watch = HangWatch(run, RunnerState(), rank=0, world_size=1, limit=10, group="")
    watch.start("a", on_hang=lambda verdict: None)
    assert not watch.active and "hang watch of rank 0 is off" in caplog.text
    (run / "heartbeats").unlink()
    (run / "hangs").symlink_to(elsewhere)
    watch.start("a", on_hang=lambda verdict: None)
    try:
        assert watch.active and (run / "heartbeats" / "rank-0.json").is_file()
        with pytest.raises(UnsafeFileError):
            watch._declare(HangVerdict("a", "rank 0 hung", 0, (0,), ()))
    finally:
        watch.stop()
    assert not any(elsewhere.iterdir())
