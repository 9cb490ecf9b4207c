"""Evaluation does not move: the same samples at every evaluation whatever the budget, an interval of its own, and a
best score found between two saves is saved and pointed to."""

from __future__ import annotations

import itertools
import json
import signal
import time

import pytest

from perdure.checkpoints.commit import read_pointer
from perdure.loggers.metrics_csv import read_metrics_csv
from perdure.runners import telemetry
from perdure.workspace.heartbeat import heartbeat_mtime
from tests.runs import run, run_dir
from tests.scripts.resumable import ResumableRunner, make_config


def trained(root, **settings) -> ResumableRunner:
    runner = ResumableRunner(make_config(root, **settings))
    runner.train()
    return runner


@pytest.mark.parametrize("eval_steps", [None, 2])
def test_the_val_loss_at_step_n_is_the_same_with_budgets_n_and_2n(tmp_path, eval_steps):
    settings = {"ckpt.interval": 10, "eval.steps": eval_steps}
    short = trained(tmp_path / "n", steps=20, **settings)
    long = trained(tmp_path / "2n", steps=40, **settings)
    assert short.results["20"] == long.results["20"]
    assert short.results["10"] == long.results["10"]
    assert set(long.results) == {"10", "20", "30", "40"}
    if eval_steps is None:  # the whole split (40 samples, 5 batches of 8) against its first 2 batches
        bounded = trained(tmp_path / "bounded", steps=20, **{**settings, "eval.steps": 2})
        assert bounded.results["20"] != short.results["20"]


def test_eval_interval_is_its_own_and_defaults_to_the_checkpoint_interval(tmp_path):
    assert list(trained(tmp_path / "default", steps=12, **{"ckpt.interval": 4}).results) == ["4", "8", "12"]
    runner = trained(tmp_path / "own", steps=12, **{"ckpt.interval": 6, "eval.interval": 4})
    assert list(runner.results) == ["4", "8", "12"]


def test_a_best_found_between_saves_is_saved_and_pointed_to(tmp_path):
    runner = trained(tmp_path, steps=12, **{"ckpt.interval": 10, "eval.interval": 3, "ckpt.keep_latest_k": 0})
    assert list(runner.results) == ["3", "6", "9", "12"]
    checkpoints = runner.run_dir.checkpoints
    saved = sorted(path.name for path in checkpoints.glob("ckpt-*"))
    best_step = runner.state.best_step
    assert best_step in (3, 6, 9, 12) and best_step != 10
    best = read_pointer(checkpoints, "best")
    assert best == f"ckpt-s{best_step:012d}" and best in saved
    manifest = json.loads((checkpoints / best / "manifest.json").read_text())
    assert manifest["score"] == runner.best_score == runner.results[str(best_step)]["val"]["loss"]
    # every improvement got a checkpoint; evaluations that did not improve did not
    improved, best_so_far = [], float("inf")
    for step, results in runner.results.items():
        if results["val"]["loss"] < best_so_far:
            best_so_far = results["val"]["loss"]
            improved.append(f"ckpt-s{int(step):012d}")
    assert set(improved) <= set(saved)
    assert set(saved) - set(improved) <= {"ckpt-s000000000010", "ckpt-s000000000012"}


def test_the_evaluation_of_a_checkpoint_step_survives_a_kill_right_after_the_commit(tmp_path):
    """Killed after checkpoint 20 is committed and before `latest` moves: the rerun continues from it and does not
    evaluate step 20 again, so the rows of that evaluation must already be in metrics.csv."""
    args = ("--steps", "30", "--ckpt.interval", "10")
    killed = run("resumable.py", tmp_path, *args, FAULT="pointer:2")
    assert killed.returncode == -signal.SIGKILL
    rerun = run("resumable.py", tmp_path, *args)
    assert rerun.returncode == 0 and "ckpt-s000000000020 (step 20)" in rerun.stdout, rerun.stdout + rerun.stderr
    rows = [(step, split) for step, split, name, _ in read_metrics_csv(run_dir(tmp_path) / "metrics.csv")
            if name == "loss" and split == "val"]  # fmt: skip
    assert rows == [(10, "val"), (20, "val"), (30, "val")]


def test_a_long_evaluation_keeps_the_heartbeat_going(tmp_path, monkeypatch):
    """The registry shows a `running` run whose heartbeat is 10 minutes old as stale (dead without a word): a run in
    an evaluation longer than that must go on beating, batch by batch, as its training steps do."""
    monkeypatch.setattr(telemetry, "HEARTBEAT_SECONDS", 0.0)
    runner = ResumableRunner(make_config(tmp_path, steps=10, **{"ckpt.interval": 10}))
    seen = []
    evaluate_step = runner.evaluate_step

    def slow_evaluate_step(batch):
        seen.append(heartbeat_mtime(runner.run_dir.path))
        time.sleep(0.02)
        return evaluate_step(batch)

    runner.evaluate_step = slow_evaluate_step
    runner.train()
    assert len(seen) == 5 and all(later > earlier for earlier, later in itertools.pairwise(seen)), seen
