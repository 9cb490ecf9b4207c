"""`perdure sweep run`: real dispatchers running real training programs (tests/scripts/sweep_job.py) and small
echo jobs, with real signals: a job that SIGTERMs itself, a dispatcher stopped with SIGTERM, one killed with
SIGKILL, two dispatchers draining one sweep at once."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from perdure.cli.main import main
from perdure.sweep.liveness import hostname, process_start_time
from perdure.sweep.matrix import job_id
from perdure.sweep.state import locked_state
from tests import zygote
from tests.runs import assert_ok, assert_same_weights, environment, read_losses
from tests.sweeps import (
    echo_command,
    finish,
    rows,
    sidecar,
    start_sweep,
    status_json,
    sweep,
    training_command,
    training_sweep,
    wait_for,
    write_matrix,
)

TRAIN = ("--steps", "20", "--log.interval", "5")


def reference_run(sweep_dir: Path, job: str, root: Path, losses: Path, **env: str) -> Path:
    """The same job run uninterrupted, outside the sweep: same argv but another workspace root. Its run dir."""
    state = json.loads((sweep_dir / "sweep.json").read_text())
    row = next(item for item in state["jobs"] if item["id"] == job)
    argv = [*state["command"]]
    argv[argv.index("--workspace.root") + 1] = str(root)
    for key, value in row["overrides"].items():
        argv += [f"--{key}", str(value)]
    result = zygote.run(argv, env=environment(LOSS_LOG=str(losses), **env), capture_output=True, text=True, timeout=240)
    assert_ok(result)
    (found,) = [path.parent for path in root.glob("*/*/sidecar.json")]
    return found


def assert_bit_equal(run_dir: str | Path, reference: Path, losses: Path, reference_losses: Path) -> None:
    assert_same_weights(
        torch.load(Path(run_dir) / "model.pth", weights_only=True),
        torch.load(reference / "model.pth", weights_only=True),
    )
    assert read_losses(losses) == read_losses(reference_losses)


def concurrency(output: str) -> int:
    """The most jobs a dispatcher ran at once, from its own start / end lines."""
    running = peak = 0
    for line in output.splitlines():
        if ": started attempt" in line:
            running += 1
            peak = max(peak, running)
        elif re.search(r": (done|failed|preempted|queued|cancelled) on ", line):
            running -= 1
    return peak


# ---------------------------------------------------------------------- a 6-job matrix on 2 slots


@pytest.fixture(scope="module")
def six_jobs(tmp_path_factory):
    """4 grid jobs, one that SIGTERMs itself at step 8, one with a bad argument; one dispatcher, 2 slots."""
    tmp = tmp_path_factory.mktemp("six")
    (tmp / "markers").mkdir()
    (tmp / "losses").mkdir()
    matrix = write_matrix(
        tmp / "matrix.yaml",
        training_command(tmp / "runs", *TRAIN),
        grid={"seed": [1, 2], "optim.lr": [0.001, 0.01]},
        jobs=[{"seed": 3, "term_at_step": 8}, {"seed": 4, "steps": "notanumber"}],
        env={"TERM_MARKERS": str(tmp / "markers"), "LOSS_LOG": str(tmp / "losses" / "{job}.jsonl")},
    )
    sweep_dir = tmp / "sweep"
    assert sweep("init", str(sweep_dir), str(matrix)).returncode == 0
    result = sweep("run", str(sweep_dir), "--slots", "2", "--poll", "0.2", timeout=240)
    return tmp, sweep_dir, result


@pytest.mark.timeout(300)
def test_six_jobs_on_two_slots(six_jobs):
    _, sweep_dir, result = six_jobs
    assert result.returncode == 1, result.stdout + result.stderr  # one job failed
    assert "nothing queued or running: 1 failed" in result.stdout
    assert concurrency(result.stdout) == 2
    view = status_json(sweep_dir)
    assert view["counts"] == {"queued": 0, "running": 0, "done": 5, "failed": 1, "preempted": 0, "cancelled": 0}
    for job in view["jobs"]:
        assert job["host"] == hostname() and job["slot"] in ("slot0", "slot1")
        if job["state"] == "done":
            assert sidecar(job["run_dir"])["status"] == "completed"
            assert set(job["last_metric"]) == {"val/loss"}
    grid = [job for job in view["jobs"] if set(job["overrides"]) == {"seed", "optim.lr"}]
    assert len(grid) == 4 and all(job["attempts"] == 1 for job in grid)
    assert len({job["run_dir"] for job in view["jobs"] if job["run_dir"]}) == 5


@pytest.mark.timeout(300)
def test_self_sigterm_job_is_requeued_and_bit_equal(six_jobs):
    tmp, sweep_dir, _ = six_jobs
    job = job_id({"seed": 3, "term_at_step": 8})
    row = rows(sweep_dir)[job]
    assert (row.state, row.attempts, row.failures) == ("done", 2, 0)
    attempts = sidecar(row.run_dir)["attempts"]
    assert [(a["status"], a["exit_reason"]) for a in attempts] == [
        ("preempted", "SIGTERM"),
        ("completed", "budget reached"),
    ]
    assert attempts[1]["resumed_step"] == 9
    log = (sweep_dir / "logs" / f"{job}.log").read_text()
    assert log.count("==> ") == 2 and "received SIGTERM: checkpointing step 9" in log
    reference = reference_run(sweep_dir, job, tmp / "reference", tmp / "reference.jsonl")
    assert_bit_equal(row.run_dir, reference, tmp / "losses" / f"{job}.jsonl", tmp / "reference.jsonl")


@pytest.mark.timeout(300)
def test_bad_argument_fails_and_is_retried_only_with_retries(six_jobs, tmp_path):
    _, sweep_dir, _ = six_jobs
    bad = rows(sweep_dir)[job_id({"seed": 4, "steps": "notanumber"})]
    assert (bad.state, bad.attempts, bad.exit_code, bad.run_dir) == ("failed", 1, 2, None)
    log = (sweep_dir / "logs" / f"{bad.id}.log").read_text()
    assert log.count("==> ") == 1 and "config key 'steps' = 'notanumber'" in log

    matrix = write_matrix(tmp_path / "m.yaml", training_command(tmp_path / "runs"), jobs=[{"steps": "x"}])
    assert sweep("init", str(tmp_path / "sw"), str(matrix)).returncode == 0
    result = sweep("run", str(tmp_path / "sw"), "--slots", "1", "--poll", "0.1", "--retries", "1", timeout=120)
    assert result.returncode == 1
    (row,) = rows(tmp_path / "sw").values()
    assert (row.state, row.attempts, row.failures) == ("failed", 2, 2)
    assert "retry 1 of 1" in result.stdout
    assert (tmp_path / "sw" / "logs" / f"{row.id}.log").read_text().count("==> ") == 2


# ---------------------------------------------------------------------- several dispatchers


@pytest.mark.timeout(300)
def test_two_dispatchers_never_run_a_job_twice(tmp_path):
    matrix = write_matrix(
        tmp_path / "m.yaml", training_command(tmp_path / "runs", "--steps", "4"), grid={"seed": [1, 2, 3, 4, 5, 6]}
    )
    sweep_dir = tmp_path / "sweep"
    assert sweep("init", str(sweep_dir), str(matrix)).returncode == 0
    dispatchers = [start_sweep("run", str(sweep_dir), "--slots", "1", "--poll", "0.05") for _ in range(2)]
    outputs = [finish(process, timeout=240) for process in dispatchers]
    assert [code for code, _ in outputs] == [0, 0], outputs
    claims = [re.findall(r"^\S+ (\S+): started attempt", output, re.M) for _, output in outputs]
    assert all(claims), f"each dispatcher ran jobs: {claims}"
    assert sorted(claims[0] + claims[1]) == sorted(rows(sweep_dir)), "every job claimed exactly once"
    for row in rows(sweep_dir).values():
        assert (row.state, row.attempts) == ("done", 1)
        assert len(sidecar(row.run_dir)["attempts"]) == 1  # the run itself started once
        assert (sweep_dir / "logs" / f"{row.id}.log").read_text().count("==> ") == 1


@pytest.mark.timeout(300)
def test_stopped_and_killed_dispatchers(tmp_path):
    """SIGTERM to a dispatcher: its jobs save and it exits 143, rows preempted. SIGKILL to the next one: its jobs
    get SIGTERM from the kernel (they die with it), save, and a third dispatcher requeues and finishes them."""
    sweep_dir = training_sweep(tmp_path, steps=40, step_sleep=0.1, seeds=[1, 2, 3])

    def training(attempt: int) -> list[str]:
        """Jobs whose log shows `attempt` starts of training (the run dir line)."""
        logs = sweep_dir / "logs"
        return (
            [path.stem for path in logs.glob("*.log") if path.read_text().count(" INFO training ") >= attempt]
            if logs.exists()
            else []
        )

    first = start_sweep("run", str(sweep_dir), "--slots", "2", "--poll", "0.2")
    interrupted = wait_for(lambda: len(training(1)) == 2 and training(1), 180, "two jobs training")
    first.send_signal(signal.SIGTERM)
    code, output = finish(first)
    assert code == 128 + signal.SIGTERM, output
    assert "received SIGTERM: forwarding it to 2 job(s)" in output
    for job in interrupted:
        row = rows(sweep_dir)[job]
        assert (row.state, row.attempts, row.pid) == ("preempted", 1, None)
        assert sidecar(row.run_dir)["attempts"][-1]["status"] == "preempted"
    (untouched,) = set(rows(sweep_dir)) - set(interrupted)
    assert rows(sweep_dir)[untouched].state == "queued"

    second = start_sweep("run", str(sweep_dir), "--slots", "2", "--poll", "0.2")
    wait_for(lambda: set(training(2)) == set(interrupted), 180, "the preempted jobs training again")
    second.kill()
    finish(second)
    assert all(rows(sweep_dir)[job].state == "running" for job in interrupted)

    third = start_sweep("run", str(sweep_dir), "--slots", "2", "--poll", "0.2")
    code, output = finish(third, timeout=240)
    assert code == 0, output
    assert output.count("died") == 2
    for job, row in rows(sweep_dir).items():
        assert row.state == "done"
        statuses = [attempt["status"] for attempt in sidecar(row.run_dir)["attempts"]]
        if job in interrupted:
            assert row.attempts == 3
            assert statuses == ["preempted", "preempted", "completed"], statuses
        else:
            assert statuses == ["completed"]
    job = interrupted[0]
    reference = reference_run(sweep_dir, job, tmp_path / "reference", tmp_path / "reference.jsonl")
    losses = tmp_path / "losses" / f"{job}.jsonl"
    assert_bit_equal(rows(sweep_dir)[job].run_dir, reference, losses, tmp_path / "reference.jsonl")


# ---------------------------------------------------------------------- small echo jobs


@pytest.mark.timeout(120)
def test_a_live_dispatchers_job_is_never_taken(tmp_path):
    """A row running under another live dispatcher stays untouched; once that dispatcher is gone it is requeued."""
    log = tmp_path / "echo.jsonl"
    matrix = write_matrix(tmp_path / "m.yaml", echo_command(), grid={"n": [1, 2]}, env={"ECHO_LOG": str(log)})
    sweep_dir = tmp_path / "sweep"
    assert main(["sweep", "init", str(sweep_dir), str(matrix)]) == 0
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (sweep_dir / "dispatchers").mkdir()
        record = {"id": "other", "host": hostname(), "pid": owner.pid, "pid_start": process_start_time(owner.pid)}
        (sweep_dir / "dispatchers" / "other.json").write_text(json.dumps({**record, "started": "x"}))
        taken = job_id({"n": 1})
        with locked_state(sweep_dir) as state:
            state.job(taken).start_attempt(host=hostname(), slot="slot0", dispatcher="other")
        dispatcher = start_sweep("run", str(sweep_dir), "--slots", "2", "--poll", "0.1")
        wait_for(lambda: rows(sweep_dir)[job_id({"n": 2})].state == "done", 60, "the free job")
        time.sleep(1.0)  # ten more polls in which it could have taken the row
        assert rows(sweep_dir)[taken].state == "running" and rows(sweep_dir)[taken].attempts == 1
        assert dispatcher.poll() is None, "it waits: a running row might still need requeueing"
    finally:
        owner.kill()
        owner.wait()
    code, output = finish(dispatcher, timeout=60)
    assert code == 0, output
    row = rows(sweep_dir)[taken]
    assert (row.state, row.attempts) == ("done", 2)
    started = [json.loads(line)["job"] for line in log.read_text().splitlines() if '"start"' in line]
    assert sorted(started) == sorted([taken, job_id({"n": 2})])


@pytest.mark.timeout(120)
def test_gpu_slots_and_cancel_of_a_running_job(tmp_path):
    log = tmp_path / "echo.jsonl"
    env = {"ECHO_LOG": str(log), "ECHO_SLEEP": "30"}
    matrix = write_matrix(tmp_path / "m.yaml", echo_command(), grid={"n": [1, 2]}, env=env)
    sweep_dir = tmp_path / "sweep"
    assert main(["sweep", "init", str(sweep_dir), str(matrix)]) == 0
    dispatcher = start_sweep("run", str(sweep_dir), "--gpus", "0,1", "--poll", "0.1")
    events = lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []  # noqa: E731
    wait_for(lambda: len(events()) == 2, 60, "both jobs started")
    assert sorted((event["job"], event["cuda"]) for event in events()) in (
        sorted([(job_id({"n": 1}), "0"), (job_id({"n": 2}), "1")]),
        sorted([(job_id({"n": 1}), "1"), (job_id({"n": 2}), "0")]),
    )
    assert main(["sweep", "cancel", str(sweep_dir)]) == 0
    code, output = finish(dispatcher, timeout=60)
    assert code == 0, output
    assert sorted(event["event"] for event in events()) == ["SIGTERM", "SIGTERM", "start", "start"]
    for row in rows(sweep_dir).values():
        assert (row.state, row.attempts, row.exit_code) == ("cancelled", 1, 143)
    assert sorted(row.slot for row in rows(sweep_dir).values()) == ["gpu0", "gpu1"]


@pytest.mark.timeout(120)
def test_ctrl_c_at_the_dispatcher_preempts_its_jobs(tmp_path):
    """SIGINT (Ctrl-C) reaches only the dispatcher (jobs run in their own sessions); it forwards it, and a job that
    stops on it is preempted, not failed."""
    log = tmp_path / "echo.jsonl"
    matrix = write_matrix(tmp_path / "m.yaml", echo_command(), jobs=[{"n": 1}], env={"ECHO_LOG": str(log)})
    sweep_dir = tmp_path / "sweep"
    assert main(["sweep", "init", str(sweep_dir), str(matrix)]) == 0
    env = environment(ECHO_SLEEP="30")
    dispatcher = start_sweep("run", str(sweep_dir), "--slots", "1", "--poll", "0.1", env=env)
    wait_for(lambda: log.exists(), 60, "the job started")
    dispatcher.send_signal(signal.SIGINT)
    code, output = finish(dispatcher, timeout=60)
    assert code == 128 + signal.SIGINT, output
    (row,) = rows(sweep_dir).values()
    assert (row.state, row.exit_code, row.attempts) == ("preempted", -signal.SIGINT, 1), row.note
