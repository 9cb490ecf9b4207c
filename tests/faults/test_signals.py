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
from tests.runs import (
    LAUNCH_DEFAULTS,
    SCRIPTS,
    assert_ok,
    assert_same_weights,
    environment,
    final_weights,
    read_losses,
    run,
    run_dir,
)

ARGS = ("--steps", "40", "--ckpt.interval", "10", "--accum_steps", "2")


def start(root, loss_log, *args, **env):
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *ARGS]
    command += args
    return subprocess.Popen(
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
    root = tmp_path_factory.mktemp("reference")
    assert_ok(run("resumable.py", root, *ARGS, LOSS_LOG=root / "losses.jsonl"))
    return root


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
    # a stop at an interval step finds that position already saved, and never saves it twice
    assert manifest["reason"] == ("interval" if stopped % 10 == 0 else "preemption")
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
