"""The workspace seen end to end: real runs get their directories, logs that survive a kill, a status, and show up
in the registry."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest

from perdure.cli.main import main as perdure_cli
from perdure.registry import Registry
from perdure.workspace.sidecar import read_sidecar
from tests import zygote
from tests.runs import SCRIPTS, assert_ok, environment, run, run_dir
from tests.scripts.resumable import Config, ResumableRunner
from tests.scripts.resumable import make_config as resumable_config


def make_config(root, **overrides) -> Config:
    return resumable_config(root, **{"steps": 8, "ckpt.interval": 4, **overrides})


def train(root, **overrides):
    runner = ResumableRunner(make_config(root, **overrides))
    runner.train()
    return runner


def test_identity_maps_configs_to_directories(tmp_path):
    base = train(tmp_path)
    assert train(tmp_path).run_dir.path == base.run_dir.path, "the same config twice is one run"
    assert train(tmp_path, **{"optim.lr": 0.01}).run_dir.path != base.run_dir.path
    assert train(tmp_path, steps=12).run_dir.path == base.run_dir.path, "a budget change extends the same run"
    assert train(tmp_path, width=48).run_dir.config_id != base.run_dir.config_id, "a user key is identity"
    assert len(list(tmp_path.glob("*/*/sidecar.json"))) == 3


def test_a_code_edit_makes_a_new_code_id(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(SCRIPTS / "resumable.py", repo / "train.py")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "train.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    sha = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = [sys.executable, str(repo / "train.py"), "--workspace.root", str(tmp_path / "runs"), "--steps", "4"]
    assert_ok(zygote.run(command, env=environment(), capture_output=True, text=True))
    with open(repo / "train.py", "a") as script:
        script.write("\n# an edit\n")
    assert_ok(zygote.run(command, env=environment(), capture_output=True, text=True))
    groups = sorted(path.name for path in (tmp_path / "runs").iterdir() if path.is_dir())
    assert groups[0] == f"resumable-{sha}" and groups[1].startswith(f"resumable-{sha}-d"), groups


def test_logs_after_a_kill_hold_each_step_once_and_wandb_keeps_its_run(tmp_path):
    args = ("--steps", "40", "--ckpt.interval", "10", "--log.interval", "5", "--tensorboard.enabled", "true")
    args += ("--wandb.enabled", "true", "--wandb.mode", "offline", "--wandb.project", "perdure-tests")
    env = {"WANDB_SILENT": "true"}
    killed = run("resumable.py", tmp_path, *args, KILL_AT_STEP="27", **env)
    assert killed.returncode == -9
    first_id = json.loads((run_dir(tmp_path) / "sidecar.json").read_text())["attempts"][0]
    rerun = run("resumable.py", tmp_path, *args, **env)
    assert_ok(rerun)
    assert "warn" not in rerun.stderr.lower(), rerun.stderr

    with open(run_dir(tmp_path) / "metrics.csv") as rows:
        counts = Counter((row["step"], row["split"], row["name"]) for row in csv.DictReader(rows))
    assert counts and max(counts.values()) == 1, [key for key, count in counts.items() if count > 1]
    assert {int(step) for step, split, name in counts if split == "train"} == set(range(5, 41, 5))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir(tmp_path) / "tensorboard"))
    events.Reload()
    steps = [event.step for event in events.Scalars("train/loss")]
    assert steps == list(range(5, 41, 5))

    sidecar = read_sidecar(run_dir(tmp_path) / "sidecar.json")
    assert sidecar["status"] == "completed"
    attempts = sidecar["attempts"]
    assert len(attempts) == 2 and attempts[0]["status"] == "interrupted"
    # killed while training step 28: steps 21..27 were trained after the checkpoint of step 20 (the heartbeat holds
    # every step, not only the last log flush's 25)
    assert attempts[1]["resumed_step"] == 20 and attempts[1]["steps_lost"] == 7
    assert first_id["started"] == attempts[0]["started"]
    import torch

    latest = run_dir(tmp_path) / "checkpoints" / "latest"
    state = torch.load(latest.parent / latest.read_text().strip() / "state.pth", weights_only=True)["state"]
    wandb_runs = sorted(path.name for path in (run_dir(tmp_path) / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and all(name.endswith(state["wandb_run_id"]) for name in wandb_runs)


class Exploding(ResumableRunner):
    def train_step(self, batch):
        if self.state.global_step == 5:
            raise RuntimeError("boom at step 5")
        return super().train_step(batch)


def test_status_transitions_and_the_registry(tmp_path, capsys):
    completed = train(tmp_path)
    with pytest.raises(RuntimeError, match="boom"):
        Exploding(make_config(tmp_path, **{"optim.lr": 0.02})).train()
    stale = ResumableRunner(make_config(tmp_path, **{"optim.lr": 0.03}))
    stale._begin_attempt()  # what train() does first: a run that started, logged, and then went silent
    stale.telemetry.flush()
    old = time.time() - 3600
    os.utime(stale.run_dir.path / "heartbeat", (old, old))
    train(tmp_path, **{"optim.lr": 0.5})

    registry = Registry(tmp_path)
    statuses = {str(record.path): record.status for record in registry.runs()}
    assert statuses[str(completed.run_dir.path)] == "completed", statuses
    assert "failed" in statuses.values() and "stale" in statuses.values()
    failed = read_sidecar(next(p for p in tmp_path.glob("*/*/sidecar.json") if "boom" in p.read_text()))
    assert "boom at step 5" in failed["attempts"][-1]["exit_reason"]

    lowest = [value for _, value in registry.best("val/loss")]
    highest = [value for _, value in registry.best("val/loss", maximize=True)]
    assert len(lowest) == len(highest) == 3  # the stale run never evaluated
    assert lowest == sorted(lowest) and highest == sorted(highest, reverse=True)
    registry.close()

    capsys.readouterr()
    assert perdure_cli(["runs", "ls", "--root", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert "stale" in listing and "failed" in listing
    (tmp_path / "registry.db").unlink()
    assert perdure_cli(["runs", "ls", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out == listing
    stale.close()


def test_a_clean_run_warns_nothing_and_its_log_file_holds_the_console(tmp_path):
    result = run("resumable.py", tmp_path, "--steps", "20", SLURM_RESTART_COUNT="2")
    assert_ok(result)
    assert result.stderr == ""
    assert " WARNING " not in result.stdout and " ERROR " not in result.stdout
    (log_file,) = (run_dir(tmp_path) / "logs").iterdir()
    logged = [line.split(" ", 2)[2] for line in log_file.read_text().splitlines()]  # "date time LEVEL ..."
    shown = [line.split(" ", 1)[1] for line in result.stdout.splitlines()]  # "time LEVEL ..."
    assert shown and logged == shown
    attempt = read_sidecar(run_dir(tmp_path) / "sidecar.json")["attempts"][0]
    assert attempt["restart_counts"] == {"SLURM_RESTART_COUNT": 2}
