"""Sweep matrices, job ids, the state file (extension, corruption), `status --json`, retry / cancel rules,
dispatcher liveness and SLURM state parsing: everything that needs no training process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perdure.cli.main import main
from perdure.sweep.dispatcher import make_slots
from perdure.sweep.liveness import DispatcherHeartbeat, dispatcher_alive, hostname, process_start_time
from perdure.sweep.matrix import SweepError, job_id, parse_matrix
from perdure.sweep.slurm import _task_ids, merged_state
from perdure.sweep.state import JOB_STATES, JobRow, locked_state
from perdure.sweep.status import JOB_KEYS
from tests.sweeps import rows, write_matrix

pytestmark = pytest.mark.timeout(60)
COMMAND = ["python", "train.py"]


def test_grid_then_jobs_with_stable_ids():
    matrix = parse_matrix(
        {
            "command": COMMAND,
            "grid": {"seed": [1, 2], "optim.lr": [0.1, 0.01]},
            "jobs": [{"width": 64, "name": "a b/c"}, {"optim.lr": 0.1, "seed": 1}, None],
        }
    )
    overrides = [job.overrides for job in matrix.jobs]
    assert overrides == [
        {"seed": 1, "optim.lr": 0.1},
        {"seed": 1, "optim.lr": 0.01},
        {"seed": 2, "optim.lr": 0.1},
        {"seed": 2, "optim.lr": 0.01},
        {"width": 64, "name": "a b/c"},
        {},
    ]
    assert matrix.duplicates == 1  # {optim.lr: 0.1, seed: 1} is the grid's first job, keys in another order
    assert matrix.jobs[0].id == job_id({"optim.lr": 0.1, "seed": 1}) == "lr0.1-seed1-" + matrix.jobs[0].id[-8:]
    assert job_id({"seed": 1}) != job_id({"seed": 1.0}) != job_id({"seed": "1"})
    assert job_id({"flag": True}) != job_id({"flag": 1})
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", job.id) for job in matrix.jobs)
    assert matrix.jobs[4].id.startswith("namea_b_c-width64-")
    assert re.fullmatch(r"[0-9a-f]{8}", matrix.jobs[5].id)
    assert matrix.jobs[0].argv(COMMAND) == ["python", "train.py", "--seed", "1", "--optim.lr", "0.1"]
    flags = parse_matrix({"command": COMMAND, "jobs": [{"ema.enabled": True, "checkpoint": None, "lr": 1e-05}]})
    assert flags.jobs[0].argv([])[1::2] == ["true", "null", "1e-05"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"command": COMMAND, "grid": {"seed": [1]}, "grdi": {}}, "unknown top-level key(s) grdi"),
        ({"command": COMMAND, "grid": {}}, "'grid' = {}: give a non-empty mapping"),
        ({"command": COMMAND, "grid": {"seed": 1}}, "grid key 'seed' = 1: give a list of values"),
        ({"command": COMMAND, "grid": {"seed": []}}, "grid key 'seed' has an empty list"),
        ({"command": COMMAND, "grid": {"seed": [[1, 2]]}}, "values must be scalars"),
        ({"command": "python train.py", "grid": {"seed": [1]}}, "write it as an argv list"),
        ({"grid": {"seed": [1]}}, "'command' is missing"),
        ({"command": COMMAND}, "no jobs"),
        ({"command": COMMAND, "jobs": {"seed": 1}}, "'jobs' = {'seed': 1}: give a list"),
        ({"command": COMMAND, "jobs": [[1]]}, "jobs[0] = [1]: each job is a mapping"),
        ({"command": COMMAND, "jobs": [{"bad key": 1}]}, "key 'bad key'"),
        ({"command": COMMAND, "jobs": [{"x": "--y"}]}, "may not start with --"),
        ({"command": COMMAND, "jobs": [{"x": float("nan")}]}, "not a finite number"),
        ({"command": COMMAND, "jobs": [{}], "env": {"1X": "a"}}, "env name '1X'"),
        (["not", "a", "mapping"], "top level must be a mapping"),
    ],
)
def test_bad_matrices_are_clear_errors(data, message):
    with pytest.raises(SweepError, match=re.escape(message)):
        parse_matrix(data)


def test_bad_matrix_on_the_command_line(tmp_path, capsys):
    (tmp_path / "m.yaml").write_text("command: [python]\ngrid: {seed: 3}\n")
    assert main(["sweep", "init", str(tmp_path / "sw"), str(tmp_path / "m.yaml")]) == 2
    assert "grid key 'seed' = 3: give a list of values" in capsys.readouterr().err
    (tmp_path / "y.yaml").write_text("command: [python\n")
    assert main(["sweep", "init", str(tmp_path / "sw"), str(tmp_path / "y.yaml")]) == 2
    assert "is not valid YAML" in capsys.readouterr().err
    assert not (tmp_path / "sw" / "sweep.json").exists()


def test_init_again_adds_new_jobs_and_keeps_old_rows(tmp_path, capsys):
    sweep_dir = tmp_path / "sw"
    matrix = write_matrix(tmp_path / "m.yaml", COMMAND, grid={"seed": [1, 2]}, env={"A": 1})
    assert main(["sweep", "init", str(sweep_dir), str(matrix)]) == 0
    first = job_id({"seed": 1})
    with locked_state(sweep_dir) as state:
        row = state.job(first)
        row.state, row.attempts, row.run_dir, row.note = "done", 1, "/somewhere", "exit 0"
    write_matrix(tmp_path / "m.yaml", COMMAND, grid={"seed": [1, 2, 3]}, jobs=[{"seed": 2}], env={"B": "x"})
    assert main(["sweep", "init", str(sweep_dir), str(matrix)]) == 0
    assert "3 job(s), 1 new, 2 kept; 1 duplicate" in capsys.readouterr().out
    found = rows(sweep_dir)
    assert list(found) == [first, job_id({"seed": 2}), job_id({"seed": 3})]
    assert (found[first].state, found[first].attempts, found[first].run_dir) == ("done", 1, "/somewhere")
    assert found[job_id({"seed": 3})].state == "queued"
    write_matrix(tmp_path / "other.yaml", ["python", "other.py"], grid={"seed": [1]})
    assert main(["sweep", "init", str(sweep_dir), str(tmp_path / "other.yaml")]) == 2
    assert "differs from this sweep's" in capsys.readouterr().err


def _valid_sweep(tmp_path: Path) -> Path:
    sweep_dir = tmp_path / "sw"
    matrix = write_matrix(tmp_path / "m.yaml", COMMAND, grid={"seed": [1, 2]})
    assert main(["sweep", "init", str(sweep_dir), str(matrix)]) == 0
    return sweep_dir


def _corrupt(kind: str, path: Path) -> None:
    good = json.loads(path.read_text())
    if kind == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif kind == "list":
        path.write_text("[1, 2]")
    elif kind == "attempts":
        good["jobs"][0]["attempts"] = "many"
        path.write_text(json.dumps(good))
    elif kind == "state":
        good["jobs"][1]["state"] = "exploded"
        path.write_text(json.dumps(good))
    elif kind == "duplicate":
        good["jobs"][1]["id"] = good["jobs"][0]["id"]
        path.write_text(json.dumps(good))
    elif kind == "nesting":
        path.write_text("[" * 200_000 + "]" * 200_000)
    elif kind == "huge":
        with open(path, "r+b") as file:
            file.truncate(65 << 20)
    elif kind == "symlink":
        target = path.with_name("elsewhere.json")
        path.rename(target)
        path.symlink_to(target)
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("garbage", "not JSON"),
        ("list", "'format' is not"),
        ("attempts", "jobs[0]: 'attempts' = 'many' has the wrong type"),
        ("state", "state 'exploded' is not one of"),
        ("duplicate", "appears twice"),
        ("nesting", "RecursionError"),
        ("huge", "more than the 67108864 allowed"),
        ("symlink", "is a symlink"),
        ("fifo", "is not a regular file"),
    ],
)
def test_hostile_state_file_is_a_clear_error(tmp_path, capsys, kind, message):
    sweep_dir = _valid_sweep(tmp_path)
    _corrupt(kind, sweep_dir / "sweep.json")
    for command in (["status"], ["status", "--json"], ["retry", "--failed"], ["cancel"], ["run", "--slots", "1"]):
        assert main(["sweep", command[0], str(sweep_dir), *command[1:]]) == 2
        error = capsys.readouterr().err
        assert error.startswith("error: ") and message in error, error
    assert main(["sweep", "status", str(tmp_path / "nothing")]) == 2
    assert "is not a sweep (no sweep.json)" in capsys.readouterr().err


def test_lock_file_that_is_not_a_file(tmp_path, capsys):
    sweep_dir = _valid_sweep(tmp_path)
    (sweep_dir / "lock").unlink()
    (sweep_dir / "lock").mkdir()
    assert main(["sweep", "cancel", str(sweep_dir)]) == 2
    assert "sweep lock" in capsys.readouterr().err


def test_status_json_has_exactly_the_documented_shape(tmp_path, capsys):
    sweep_dir = _valid_sweep(tmp_path)
    capsys.readouterr()
    with locked_state(sweep_dir) as state:
        row = state.jobs[0]
        row.start_attempt(host="h", slot="slot0", dispatcher="d")
        row.finish_attempt(1)
    assert main(["sweep", "status", str(sweep_dir), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert set(view) == {"jobs", "counts"}
    assert view["counts"] == {"queued": 1, "running": 0, "done": 0, "failed": 1, "preempted": 0, "cancelled": 0}
    assert set(view["counts"]) == set(JOB_STATES)
    for job in view["jobs"]:
        assert tuple(job) == JOB_KEYS
    failed, queued = view["jobs"]
    assert failed == {
        "id": job_id({"seed": 1}),
        "overrides": {"seed": 1},
        "state": "failed",
        "attempts": 1,
        "host": "h",
        "slot": "slot0",
        "run_dir": None,
        "last_metric": None,
    }
    assert (queued["state"], queued["attempts"], queued["host"]) == ("queued", 0, None)
    assert main(["sweep", "status", str(sweep_dir)]) == 0
    table = capsys.readouterr().out
    assert "ID" in table and "LAST METRIC" in table and "2 job(s): 1 queued, 1 failed" in table


def test_retry_and_cancel_rules(tmp_path, capsys):
    sweep_dir = _valid_sweep(tmp_path)
    one, two = job_id({"seed": 1}), job_id({"seed": 2})
    live = DispatcherHeartbeat(sweep_dir)  # this test process plays a live dispatcher
    with locked_state(sweep_dir) as state:
        state.job(one).start_attempt(host="h", slot="slot0", dispatcher=live.id)
        state.job(one).finish_attempt(2)
        state.job(two).start_attempt(host="h", slot="slot1", dispatcher=live.id)
    assert main(["sweep", "retry", str(sweep_dir)]) == 2
    assert "job ids, or --failed" in capsys.readouterr().err
    assert main(["sweep", "retry", str(sweep_dir), two]) == 2
    assert "still running" in capsys.readouterr().err
    assert main(["sweep", "retry", str(sweep_dir), "nope"]) == 2
    assert "no job 'nope'" in capsys.readouterr().err
    assert main(["sweep", "retry", str(sweep_dir), "--failed"]) == 0
    assert rows(sweep_dir)[one].state == "queued" and rows(sweep_dir)[one].failures == 0
    assert main(["sweep", "cancel", str(sweep_dir)]) == 0
    assert {row.state for row in rows(sweep_dir).values()} == {"cancelled"}
    assert main(["sweep", "cancel", str(sweep_dir)]) == 0
    assert "nothing to cancel" in capsys.readouterr().out
    assert main(["sweep", "retry", str(sweep_dir), one]) == 0
    assert rows(sweep_dir)[one].state == "queued"
    assert main(["sweep", "retry", str(sweep_dir), two]) == 2  # cancelled, but its live dispatcher still stops it
    assert "still running" in capsys.readouterr().err
    live.remove()  # that dispatcher is gone (and so is its job): the row can be retried
    assert main(["sweep", "retry", str(sweep_dir), two]) == 0
    assert (rows(sweep_dir)[two].state, rows(sweep_dir)[two].dispatcher) == ("queued", None)


def test_exit_codes_map_to_states():
    row = JobRow("x", {})
    for code, expected in [(0, "done"), (143, "preempted"), (138, "preempted"), (-15, "preempted"), (1, "failed")]:
        row.state, row.failures = "running", 0
        row.finish_attempt(code)
        assert row.state == expected, code
    row.state, row.failures = "running", 0
    row.finish_attempt(2, retries=1)
    assert (row.state, row.failures) == ("queued", 1)
    row.finish_attempt(2, retries=1)
    assert (row.state, row.failures) == ("failed", 2)
    row.finish_attempt(-9)
    assert row.note.startswith("killed by SIGKILL")


def test_slots():
    assert [slot.name for slot in make_slots(slots=2)] == ["slot0", "slot1"]
    gpus = make_slots(gpus="0,1,2,3", gpus_per_job=2)
    assert [(slot.name, slot.cuda) for slot in gpus] == [("gpu0,1", "0,1"), ("gpu2,3", "2,3")]
    for bad in ({"slots": 0}, {"gpus": "0,,1"}, {"gpus": "0,0"}, {"gpus": "0,1,2", "gpus_per_job": 2}, {}):
        with pytest.raises(SweepError):
            make_slots(**bad)


def test_dispatcher_liveness(tmp_path):
    me = DispatcherHeartbeat(tmp_path)
    assert dispatcher_alive(tmp_path, me.id)
    assert not dispatcher_alive(tmp_path, "never-registered")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    record = {"id": "dead", "host": hostname(), "pid": dead.pid, "pid_start": 1, "started": "x"}
    (tmp_path / "dispatchers" / "dead.json").write_text(json.dumps(record))
    assert not dispatcher_alive(tmp_path, "dead")
    record = {"id": "reused", "host": hostname(), "pid": os.getpid(), "pid_start": process_start_time(os.getpid()) - 1}
    (tmp_path / "dispatchers" / "reused.json").write_text(json.dumps({**record, "started": "x"}))
    assert not dispatcher_alive(tmp_path, "reused")  # a live pid that started at another time is someone else
    far = {"id": "far", "host": "another-host", "pid": 1, "pid_start": None, "started": "x"}
    (tmp_path / "dispatchers" / "far.json").write_text(json.dumps(far))
    assert dispatcher_alive(tmp_path, "far", stale_after=60)
    old = time.time() - 120
    os.utime(tmp_path / "dispatchers" / "far.json", (old, old))
    assert not dispatcher_alive(tmp_path, "far", stale_after=60)
    me.remove()
    assert not dispatcher_alive(tmp_path, me.id)


def test_slurm_task_ids_and_merged_states():
    assert _task_ids("3") == [3]
    assert _task_ids("0-2") == [0, 1, 2]
    assert _task_ids("1,4-5%2") == [1, 4, 5]
    assert _task_ids("junk") == []
    row = JobRow("x", {}, state="running", slurm_job="7_1")
    assert merged_state(row, {"7_1": ("PENDING", 1)}) == "queued"
    assert merged_state(row, {"7_1": ("CANCELLED+", 0)}) == "cancelled"
    assert merged_state(row, {}) == "running"
    row.state = "preempted"
    assert merged_state(row, {"7_1": ("PENDING", 1)}) == "preempted"
    row.state = "done"
    assert merged_state(row, {"7_1": ("FAILED", 0)}) == "done"


def test_submit_with_a_stand_in_sbatch(tmp_path, capsys, monkeypatch):
    """What `submit` hands to sbatch and records, with a stand-in `sbatch` / `scancel` that log their arguments
    (the real cluster is in test_sweep_slurm.py)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, answer in (("sbatch", "77;cluster"), ("scancel", "")):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/{name}.args\necho "{answer}"\n')
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    sweep_dir = tmp_path / "sw"
    write_matrix(tmp_path / "m.yaml", COMMAND, grid={"seed": [1, 2, 3]})
    assert main(["sweep", "init", str(sweep_dir), str(tmp_path / "m.yaml")]) == 0
    assert main(["sweep", "submit", str(sweep_dir)]) == 2
    assert "add --slurm" in capsys.readouterr().err
    assert main(["sweep", "submit", str(sweep_dir), "--slurm", "--sbatch-arg=--array=1"]) == 2
    assert "not --array/--output" in capsys.readouterr().err
    argv = ["sweep", "submit", str(sweep_dir), "--slurm", "--partition", "gpu", "--time", "4:00:00"]
    assert main([*argv, "--gpus-per-job", "2", "--signal-before", "90", "--max-tasks", "2"]) == 0
    assert "submitted array job 77: 2 task(s)" in capsys.readouterr().out
    (args,) = (tmp_path / "sbatch.args").read_text().splitlines()
    for option in ("--requeue", "--open-mode=append", "--signal=B:USR1@90", "--partition=gpu", "--time=4:00:00"):
        assert option in args.split()
    assert (
        "--gres=gpu:2" in args and "--array=0-1" in args and f"--output={sweep_dir.resolve()}/slurm/%A_%a.out" in args
    )
    script = Path(args.split()[-1]).read_text()
    assert f"jobs=({job_id({'seed': 1})} {job_id({'seed': 2})})" in script
    assert "scontrol requeue" in script and "sweep task" in script
    found = rows(sweep_dir)
    assert [found[job_id({"seed": s})].slurm_job for s in (1, 2, 3)] == ["77_0", "77_1", None]
    assert main(["sweep", "cancel", str(sweep_dir), job_id({"seed": 2})]) == 0
    assert (tmp_path / "scancel.args").read_text().split() == ["77_1"]
    assert main(["sweep", "submit", str(sweep_dir), "--slurm"]) == 0  # the rest: seed 3 only
    assert "1 task(s)" in capsys.readouterr().out
    assert main(["sweep", "submit", str(sweep_dir), "--slurm"]) == 2
    assert "nothing to submit" in capsys.readouterr().err
    assert main(["sweep", "task", str(sweep_dir), job_id({"seed": 1})]) == 2  # outside an array task
    assert "runs inside a SLURM array task" in capsys.readouterr().err
