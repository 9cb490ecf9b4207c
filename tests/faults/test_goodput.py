"""Goodput of a run SIGKILLed once and resumed: each attempt's parts add up to its wall time (from the process's own
start), the killed attempt's lost part is its lost steps x their step time, and `perdure runs show` / `ls` say it.

One killed launch and one resume, read by every assertion (the launches are the cost of this module)."""

from __future__ import annotations

import csv
import statistics

import pytest

from perdure.cli.main import main as perdure_cli
from perdure.workspace.goodput import ATTEMPT_PARTS, RUN_PARTS
from perdure.workspace.sidecar import parse_stamp, read_sidecar
from tests.runs import run, run_dir

pytestmark = pytest.mark.timeout(240)

# 0.1 s a step; the program SIGKILLs itself when step 40 starts: 39 steps trained, the last checkpoint at step 20
ARGS = ("--steps", "50", "--ckpt.interval", "20", "--log.interval", "5", "--eval.interval", "1000")
SLOW = {"STEP_SLEEP": "0.1"}


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("goodput")
    killed = run("resumable.py", root, *ARGS, KILL_AT_STEP="39", **SLOW)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    resumed = run("resumable.py", root, *ARGS, **SLOW)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return root, read_sidecar(run_dir(root) / "sidecar.json")


def wall(attempt):
    return parse_stamp(attempt["ended"]) - parse_stamp(attempt["process_started"])


def test_each_attempt_adds_up_to_its_wall_time_from_the_process_start(killed_and_resumed):
    _, sidecar = killed_and_resumed
    killed, resumed = sidecar["attempts"]
    assert (killed["status"], resumed["status"]) == ("interrupted", "completed")
    for attempt in (killed, resumed):
        seconds = attempt["goodput"]["seconds"]
        assert set(seconds) == set(ATTEMPT_PARTS) and all(value >= 0 for value in seconds.values())
        assert sum(seconds.values()) == pytest.approx(wall(attempt), rel=0.01)
        # the process started before the attempt's training did: start-up belongs to the attempt
        assert parse_stamp(attempt["process_started"]) < parse_stamp(attempt["started"])
        assert seconds["startup"] > 0 and seconds["compile"] > 0 and seconds["kept_training"] > 0
        assert attempt["goodput"]["fraction"] == pytest.approx(seconds["kept_training"] / wall(attempt), rel=0.01)
    assert resumed["goodput"]["seconds"]["restore"] > 0 and resumed["goodput"]["seconds"]["lost_training"] == 0


def test_the_killed_attempt_lost_every_step_after_its_last_checkpoint(killed_and_resumed):
    root, sidecar = killed_and_resumed
    killed, resumed = sidecar["attempts"]
    assert resumed["resumed_step"] == 20
    # steps 21..39, all trained before the SIGKILL (not only those up to the sidecar's last write): the resumed
    # attempt records what the interruption cost, the killed one's goodput counts them lost
    assert resumed["steps_lost"] == 19 and killed["goodput"]["lost_steps"] == 19
    with open(run_dir(root) / "metrics.csv") as rows:
        step_times = [float(row["value"]) for row in csv.DictReader(rows) if row["name"] == "step_time"]
    step_time = statistics.median(step_times)
    assert killed["goodput"]["seconds"]["lost_training"] == pytest.approx(19 * step_time, rel=0.10)


def test_the_run_adds_its_attempts_and_the_gap_between_them(killed_and_resumed, capsys):
    root, sidecar = killed_and_resumed
    run_goodput = sidecar["goodput"]
    assert set(run_goodput["seconds"]) == set(RUN_PARTS)
    attempts = sidecar["attempts"]
    gap = parse_stamp(attempts[1]["process_started"]) - parse_stamp(attempts[0]["ended"])
    assert run_goodput["seconds"]["queue"] == pytest.approx(max(gap, 0.0), abs=1e-3)
    total = sum(wall(attempt) for attempt in attempts) + run_goodput["seconds"]["queue"]
    assert sum(run_goodput["seconds"].values()) == pytest.approx(total, rel=0.01)
    fraction = f"{100 * run_goodput['fraction']:.1f}%"

    capsys.readouterr()
    assert perdure_cli(["runs", "show", run_dir(root).name, "--root", str(root)]) == 0
    shown = capsys.readouterr().out
    assert f"goodput {fraction} of the run's wall time trained the model" in shown
    assert "lost_training" in shown and "checkpoint_stall" in shown
    assert perdure_cli(["runs", "ls", "--root", str(root)]) == 0
    listed = capsys.readouterr().out
    assert "GOODPUT" in listed.splitlines()[0] and fraction in listed
    assert perdure_cli(["runs", "export", str(root / "runs.csv"), "--root", str(root)]) == 0
    with open(root / "runs.csv") as exported:
        (row,) = csv.DictReader(exported)
    assert float(row["goodput"]) == run_goodput["fraction"]
