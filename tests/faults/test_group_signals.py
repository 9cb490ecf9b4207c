"""Signals to every process of the job, as SLURM, torchrun and most launchers send them: DataLoader workers get the
signal too. The run still stops at an agreed step, saves it, exits 128 + signal, and the rerun is bit-equal to an
uninterrupted run; the loader's own shutdown of its workers (a SIGTERM from their parent) still works."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import Dataset

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from perdure.data.loader import ResumableLoader
from tests import zygote
from tests.runs import (
    LAUNCH_DEFAULTS,
    SCRIPTS,
    assert_all_ok,
    assert_ok,
    assert_same_weights,
    built_once,
    environment,
    final_weights,
    read_losses,
    run,
    run_dir,
    run_ranks,
    skip_unless_ranks_fit,
    wait_for_lines,
)

ARGS = ("--steps", "40", "--ckpt.interval", "20", "--dataloader.num_workers", "2")  # epochs of 13 steps
# A map-style dataset, with the checkpoint writer process (also signalled); a stream that saves its position.
CASES = {"map": ({}, ("--ckpt.async_mode", "process")), "stream": ({"ITERABLE": "stateful"}, ())}


def start_in_own_group(command: list[str], **env: str) -> subprocess.Popen:
    """Start `command` as a job step is started: the leader of a process group of its own, so that a signal to the
    group reaches it and every process it starts (its DataLoader workers, torchrun's ranks)."""
    return subprocess.Popen(
        command, env=environment(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def stopped_step(output: str, signum: int) -> int:
    steps = set(re.findall(rf"received {signal.Signals(signum).name}: checkpointing step (\d+)", output))
    assert len(steps) == 1, output
    return int(steps.pop())


def assert_saved_at(root, step: int) -> None:
    checkpoints = run_dir(root) / "checkpoints"
    assert verify_checkpoint(checkpoints / read_pointer(checkpoints, "latest"))["global_step"] == step


def assert_resumed_bit_equal(reference, root, resumed_log, stopped: int) -> None:
    expected, resumed = read_losses(reference / "losses.jsonl"), read_losses(resumed_log)
    assert min(position[1] for position in resumed) == stopped
    assert {position: expected[position] for position in resumed} == resumed
    assert_same_weights(final_weights(reference), final_weights(root))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("dataset", "signum"), [("map", signal.SIGTERM), ("stream", signal.SIGINT)])
def test_a_signal_to_the_group_of_a_run_with_workers_is_a_preemption(tmp_path_factory, tmp_path, dataset, signum):
    """Before: the workers died of SIGTERM and the run failed with `DataLoader worker (pid ...) is killed by signal:
    Terminated.`, exit 1, no preemption save (the 20 steps since the interval save were lost)."""
    knobs, extra = CASES[dataset]
    args = (*ARGS, *extra)
    reference = built_once(
        tmp_path_factory,
        f"group-signals-{dataset}",
        lambda root: assert_ok(run("resumable.py", root, *args, LOSS_LOG=root / "losses.jsonl", **knobs)),
    )
    root, loss_log = tmp_path / "run", tmp_path / "losses.jsonl"
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *args]
    process = start_in_own_group(command, LOSS_LOG=loss_log, STEP_SLEEP="0.05", **knobs)
    wait_for_lines(loss_log, 24, [process])  # past the first interval save, in the second epoch's workers
    workers = [child for child in _children(process.pid)]
    assert len(workers) >= 2, "the run has no DataLoader workers to signal"
    os.killpg(process.pid, signum)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, output
    assert "DataLoader worker" not in output and "writer process" not in output
    stopped = stopped_step(output, signum)
    assert 20 < stopped < 40
    assert_saved_at(root, stopped)

    resumed_log = tmp_path / "resumed.jsonl"
    assert_ok(run("resumable.py", root, *args, LOSS_LOG=resumed_log, **knobs))
    assert_resumed_bit_equal(reference, root, resumed_log, stopped)


@pytest.mark.timeout(300)
def test_sigterm_to_a_torchrun_launch_with_workers_stops_every_rank_at_one_step(tmp_path):
    """torchrun forwards a SIGTERM to each rank's process group (ranks and their workers); SLURM signals them all."""
    skip_unless_ranks_fit(2)
    reference = tmp_path / "reference"
    assert_all_ok(run_ranks(2, "resumable.py", reference, *ARGS, LOSS_LOG=str(tmp_path / "reference-{rank}.jsonl")))

    root, loss_log = tmp_path / "run", tmp_path / "losses-{rank}.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["--shutdown-timeout", "100"]  # the ranks read it from torchrun's command line (resilience/grace.py)
    command += [str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *LAUNCH_DEFAULTS, *ARGS]
    launch = start_in_own_group(command, LOSS_LOG=loss_log, STEP_SLEEP="0.05")
    wait_for_lines(tmp_path / "losses-1.jsonl", 24, [launch], timeout=180)
    os.killpg(launch.pid, signal.SIGTERM)
    output, _ = launch.communicate(timeout=120)
    assert "DataLoader worker" not in output
    assert "grace window 100s (torchrun's --shutdown-timeout 100); the first save took" in output
    stopped = stopped_step(output, signal.SIGTERM)
    assert output.count(f"received SIGTERM: checkpointing step {stopped}") == 2, output
    assert 20 < stopped < 40
    assert_saved_at(root, stopped)
    # torchrun itself exits 1 (its SignalException); the ranks exited 143, as the attempt's record says
    sidecar = json.loads((run_dir(root) / "sidecar.json").read_text())
    assert (sidecar["status"], sidecar["attempts"][-1]["exit_reason"]) == ("preempted", "SIGTERM"), sidecar

    resumed_log = tmp_path / "resumed-{rank}.jsonl"
    assert_all_ok(run_ranks(2, "resumable.py", root, *ARGS, LOSS_LOG=str(resumed_log)))
    for rank in range(2):
        expected, resumed = (
            read_losses(tmp_path / f"reference-{rank}.jsonl"),
            read_losses(tmp_path / f"resumed-{rank}.jsonl"),
        )
        assert min(position[1] for position in resumed) == stopped
        assert {position: expected[position] for position in resumed} == resumed
    assert_same_weights(final_weights(reference), final_weights(root))


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as children:
        return [int(child) for child in children.read().split()]


class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        time.sleep(0.02)
        return torch.tensor([index])


def _workers() -> set[multiprocessing.Process]:
    return {child for child in multiprocessing.active_children() if child.daemon}


@pytest.mark.timeout(60)
def test_workers_drop_a_signal_from_outside_and_obey_their_loaders_sigterm():
    """A worker ignores a SIGTERM, SIGUSR1 or SIGINT that someone else sends (the training process decides), reads its
    epoch to the end, and exits with its loader's shutdown; a SIGTERM from its parent (how torch and multiprocessing
    stop a worker that is still alive) still ends it at once."""
    loader = ResumableLoader(Slow(), batch_size=4, shuffle=False, num_workers=2)
    before = _workers()
    batches = loader.iter_epoch(0)
    first = next(batches)
    workers = _workers() - before
    assert len(workers) == 2
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        for worker in workers:
            subprocess.run(["kill", f"-{signum.name[3:]}", str(worker.pid)], check=True)  # not from the parent
    time.sleep(0.3)
    assert all(worker.is_alive() for worker in workers)
    rest = list(batches)
    assert torch.cat([first, *rest]).flatten().tolist() == list(range(64))
    del batches, rest
    for worker in workers:
        worker.join(timeout=10)
        assert worker.exitcode == 0

    before = _workers()
    batches = loader.iter_epoch(1)
    next(batches)
    workers = _workers() - before
    for worker in workers:
        worker.terminate()  # SIGTERM from the parent
    for worker in workers:
        worker.join(timeout=10)
        assert worker.exitcode == 0, "torch's rule: a worker its parent terminates exits quietly"
    del batches


@pytest.mark.timeout(60)
def test_a_program_that_exits_with_live_workers_is_not_held_by_them():
    """At interpreter exit torch leaves live workers to multiprocessing, which stops them with SIGTERM: a worker that
    ignored every SIGTERM would hold the program's exit forever."""
    code = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); from tests.faults.test_group_signals import Slow; "
        "from perdure.data.loader import ResumableLoader; "
        "loader = ResumableLoader(Slow(), batch_size=4, shuffle=False, num_workers=2); "
        "batches = loader.iter_epoch(0); next(batches); print('read', flush=True)"
    )
    started = time.monotonic()
    result = zygote.run([sys.executable, "-c", code, str(SCRIPTS.parent.parent)], env=environment(),
                        capture_output=True, text=True, timeout=40)  # fmt: skip
    assert result.returncode == 0 and result.stdout == "read\n", result.stdout + result.stderr
    assert time.monotonic() - started < 20
