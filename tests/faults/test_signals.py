"""SIGTERM, SIGUSR1 and SIGINT at random steps: the run saves the step it stopped at, exits with 128 + signal, and
the rerun is bit-equal to an uninterrupted run. A second launch of a live run fails at once."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from tests import zygote
from tests.runs import (
    LAUNCH_DEFAULTS,
    SCRIPTS,
    assert_ok,
    assert_same_weights,
    built_once,
    environment,
    final_weights,
    read_losses,
    run,
    run_dir,
)
from tests.runs import start as start_run

ARGS = ("--steps", "40", "--ckpt.interval", "10", "--accum_steps", "2")


def start(root, loss_log, *args, **env):
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *ARGS]
    command += args
    return zygote.popen(
        command,
        env=environment(LOSS_LOG=loss_log, STEP_SLEEP="0.03", **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_losses(loss_log, count, process, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if loss_log.exists() and len(loss_log.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.005)
    raise AssertionError("training did not progress")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return built_once(
        tmp_path_factory,
        "signals-reference",
        lambda root: assert_ok(run("resumable.py", root, *ARGS, LOSS_LOG=root / "losses.jsonl")),
    )


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_saves_the_step_and_resumes_bit_exact(reference, tmp_path, signum):
    root, loss_log = tmp_path / "run", tmp_path / "losses.jsonl"
    micro_batches = random.Random(int(signum)).randint(15, 60)
    process = start(root, loss_log)
    wait_for_losses(loss_log, micro_batches, process)
    process.send_signal(signum)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, output

    stopped = int(re.search(r"received \w+: checkpointing step (\d+)", output).group(1))
    assert 0 < stopped < 40
    checkpoints = run_dir(root) / "checkpoints"
    latest = read_pointer(checkpoints, "latest")
    manifest = verify_checkpoint(checkpoints / latest)
    assert manifest["global_step"] == stopped
    # a stop at an interval step finds that position already saved, and never saves it twice, unless the signal
    # stopped that step's evaluation (then the interval save never came)
    evaluation_stopped = f"evaluation of step {stopped} stopped" in output
    assert evaluation_stopped <= (stopped % 10 == 0)
    interval_saved = stopped % 10 == 0 and not evaluation_stopped
    assert manifest["reason"] == ("interval" if interval_saved else "preemption")
    trained_steps = {json.loads(line)["step"] for line in loss_log.read_text().splitlines()}
    assert max(trained_steps) == stopped - 1, "the loop must stop right after the step it was in"

    resumed_log = tmp_path / "resumed.jsonl"
    assert_ok(run("resumable.py", root, *ARGS, LOSS_LOG=resumed_log))
    expected = read_losses(reference / "losses.jsonl")
    resumed = read_losses(resumed_log)
    assert min(position[1] for position in resumed) == stopped
    for position, loss in resumed.items():
        assert expected[position] == loss
    assert_same_weights(final_weights(reference), final_weights(root))


def test_configured_exit_code_and_async_drain(tmp_path):
    root, loss_log = tmp_path / "run", tmp_path / "losses.jsonl"
    process = start(root, loss_log, "--resilience.exit_code", "75", "--ckpt.async_mode", "thread")
    wait_for_losses(loss_log, 10, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 75, output
    checkpoints = run_dir(root) / "checkpoints"
    assert verify_checkpoint(checkpoints / read_pointer(checkpoints, "latest"))["reason"] == "preemption"


def test_second_launch_of_a_live_run_fails_at_once(tmp_path):
    root, loss_log = tmp_path / "run", tmp_path / "losses.jsonl"
    first = start(root, loss_log, "--steps", "400")  # long enough to outlive the second launch's start on a busy host
    try:
        wait_for_losses(loss_log, 2, first)
        started = time.monotonic()
        second = run("resumable.py", root, *ARGS)
        assert second.returncode != 0
        assert f"in use by pid {first.pid}" in second.stderr + second.stdout
        assert "Traceback" not in second.stderr
        assert time.monotonic() - started < 20
    finally:
        first.kill()
        first.wait()
    # The killed holder's lock never blocks: the next launch resumes.
    assert_ok(run("resumable.py", root, *ARGS))


EVAL_ARGS = ("--ckpt.interval", "10", "--dataloader.batch_size", "8")  # 40 val samples: 5 batches per evaluation


def val_rows(root):
    """(step, name, value) of every `val` metric the run reported, in order."""
    lines = (run_dir(root) / "metrics.csv").read_text().splitlines()[1:]
    return [tuple(row[:1] + row[2:]) for row in (line.split(",") for line in lines) if row[1] == "val"]


def sigterm_in_an_evaluation(root, eval_log, *args, **knobs):
    """Start resumable.py, SIGTERM it once its first evaluation batch began, expect exit 143; its output."""
    process = start_run("resumable.py", root, *args, **knobs, EVAL_LOG=eval_log)
    wait_for_losses(eval_log, 1, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, output
    return output


# The budget, and the step whose evaluation the signal lands in: the first evaluation (every 10 steps; an epoch of 100
# samples in batches of 8 is 13 steps). With 10 steps it is the last step's; with 2 epochs the first epoch's.
BUDGETS = {"steps-20": (("--steps", "20"), 10), "last-step": (("--steps", "10"), 10), "epochs": (("--epochs", "2"), 13)}


@pytest.mark.parametrize("budget", BUDGETS)
def test_signal_during_an_evaluation_stops_it_and_the_rerun_evaluates_that_step_first(tmp_path, budget):
    """A long evaluation must not hold a preempted job past its grace period (SLURM then SIGKILLs it, and the steps
    since the last save are lost): SIGTERM in the first evaluation stops it at the next batch, saves that step and
    exits 143. The next attempt evaluates that step first, and is stopped there too; the one after that evaluates it,
    drawing what the uninterrupted run drew there (the evaluation draws from torch's generator: a stopped one must
    give back what it drew), and continues bit for bit: losses, weights, every evaluation's metrics and `best`."""
    budget_args, stopped = BUDGETS[budget]
    args, knobs = (*EVAL_ARGS, *budget_args), {"EVAL_SLEEP": "0.2", "EVAL_DRAW": "1"}
    reference = tmp_path / "reference"
    assert_ok(run("resumable.py", reference, *args, **knobs, LOSS_LOG=reference / "losses.jsonl"))

    root, eval_log = tmp_path / "run", tmp_path / "eval.jsonl"
    output = sigterm_in_an_evaluation(root, eval_log, *args, **knobs)
    assert f"evaluation of step {stopped} stopped at batch" in output
    assert f"received SIGTERM: checkpointing step {stopped}" in output
    assert len(eval_log.read_text().splitlines()) < 5, "the evaluation ran to its end"
    checkpoints = run_dir(root) / "checkpoints"
    assert verify_checkpoint(checkpoints / read_pointer(checkpoints, "latest"))["reason"] == "preemption"
    assert val_rows(root) == [], "a stopped evaluation reports nothing"
    saved = read_pointer(checkpoints, "latest")

    # Stopped again in that evaluation, run first by the next attempt: nothing new to save, the step stays pending.
    output = sigterm_in_an_evaluation(root, tmp_path / "eval-again.jsonl", *args, **knobs)
    assert f"evaluating step {stopped}, which the last attempt was stopped in" in output
    assert f"evaluation of step {stopped} stopped at batch" in output and "Traceback" not in output
    assert read_pointer(checkpoints, "latest") == saved and val_rows(root) == []

    resumed_log = tmp_path / "resumed.jsonl"
    result = run("resumable.py", root, *args, **knobs, LOSS_LOG=resumed_log)
    assert_ok(result)
    assert f"evaluating step {stopped}, which the last attempt was stopped in" in result.stdout
    expected = read_losses(reference / "losses.jsonl")
    resumed = read_losses(resumed_log) if resumed_log.exists() else {}  # the last step's: the rerun only evaluates
    assert resumed.keys() == {position for position in expected if position[1] >= stopped}
    for position, loss in resumed.items():
        assert expected[position] == loss
    assert_same_weights(final_weights(reference), final_weights(root))
    assert val_rows(root) == val_rows(reference) and {row[1] for row in val_rows(root)} == {"loss", "draw"}
    best = read_pointer(run_dir(reference) / "checkpoints", "best")
    assert read_pointer(checkpoints, "best") == best
