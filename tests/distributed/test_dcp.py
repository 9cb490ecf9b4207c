"""The DCP backend on CPU / gloo: kills of every rank (sync, thread and process async), a rank killed in the middle of
a DCP save, resumes on 1 and 4 ranks from a checkpoint written by 2, a single process, and how the backend is chosen.
Ranks are started as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR / PORT)."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
import torch

from perdure import ConfigError, FileCheckpointManager
from perdure.checkpoints.async_save import AsyncSaver, SaveJob
from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from perdure.checkpoints.dcp import DCPCheckpointManager, read_dcp_weights
from perdure.checkpoints.deepspeed_engine import DeepSpeedCheckpointManager
from perdure.checkpoints.select import manager_class
from perdure.checkpoints.snapshot import Snapshot
from perdure.runners.export import read_weights
from tests.runs import (
    assert_all_ok,
    assert_ok,
    assert_same_weights,
    epoch_samples,
    final_weights,
    read_losses,
    run,
    run_dir,
    run_ranks,
    start_ranks,
)
from tests.scripts.resumable import ResumableRunner, make_config
from tests.test_save_watch import writer_processes

ARGS = ("--steps", "30", "--ckpt.interval", "5", "--ckpt.backend", "dcp", "--dist.timeout", "60")
ARGS += ("--dataset_size", "96", "--dataloader.batch_size", "4")
TIMEOUT = 150  # seconds one launch of the ranks may take before the test fails

pytestmark = pytest.mark.timeout(400)


def wait_for(root, pattern, processes, timeout=120):
    deadline = time.monotonic() + timeout
    while not list(root.glob(pattern)):
        for process in processes:
            assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.01)


def latest(root):
    checkpoints = run_dir(root) / "checkpoints"
    return checkpoints / read_pointer(checkpoints, "latest")


def compare_with_reference(reference, root, logs, ranks=2):
    for rank in range(ranks):
        expected = read_losses(reference / f"losses-{rank}.jsonl")
        resumed = read_losses(logs / f"rerun-{rank}.jsonl")
        assert resumed and min(resumed) > (0, 0, 0), "the rerun resumed instead of starting over"
        for position, loss in resumed.items():
            assert expected[position] == loss, f"rank {rank}: loss at {position} differs"
    assert_same_weights(final_weights(reference), final_weights(root))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    assert_all_ok(run_ranks(2, "resumable.py", root, *ARGS, timeout=TIMEOUT, LOSS_LOG=root / "losses-{rank}.jsonl"))
    manifest = verify_checkpoint(latest(root))
    assert manifest["backend"] == "dcp" and manifest["world_size"] == 2 and manifest["global_step"] == 30
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "replicated.pth", "rank00000.pth", "rank00001.pth"} <= set(
        manifest["files"]
    )
    return root


@pytest.mark.parametrize("mode", ["disabled", "thread", "process"])
def test_sigkill_of_every_rank_and_rerun_is_bit_exact(reference, tmp_path, mode):
    root, args = tmp_path / "run", (*ARGS, "--ckpt.async_mode", mode)
    processes = start_ranks(2, "resumable.py", root, *args, STEP_SLEEP="0.02")
    try:
        wait_for(root, "*/*/checkpoints/ckpt-s000000000010/manifest.json", processes)
    finally:
        for process in processes:
            process.send_signal(signal.SIGKILL)
    for process in processes:
        process.communicate(timeout=60)
        assert process.returncode == -signal.SIGKILL
    assert not (run_dir(root) / "model.pth").exists()
    rerun = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout
    compare_with_reference(reference, root, tmp_path)
    assert verify_checkpoint(latest(root))["global_step"] == 30


def test_sigterm_to_one_rank_saves_every_rank_with_an_async_dcp_save(reference, tmp_path):
    root, args = tmp_path / "run", (*ARGS, "--ckpt.async_mode", "thread")
    processes = start_ranks(2, "resumable.py", root, *args, STEP_SLEEP="0.03", LOSS_LOG=tmp_path / "first-{rank}.jsonl")
    first_log = tmp_path / "first-0.jsonl"
    deadline = time.monotonic() + 120
    while not (first_log.exists() and len(first_log.read_text().splitlines()) >= 12):
        assert time.monotonic() < deadline and all(process.poll() is None for process in processes)
        time.sleep(0.01)
    processes[1].send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [143, 143], outputs
    stopped = int(re.search(r"checkpointing step (\d+)", outputs[0]).group(1))
    manifest = verify_checkpoint(latest(root))  # the preemption save was drained before the exit
    assert manifest["global_step"] == stopped and manifest["reason"] == "preemption" and manifest["world_size"] == 2
    rerun = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")
    assert_all_ok(rerun)
    compare_with_reference(reference, root, tmp_path)


@pytest.mark.parametrize("mode", ["disabled", "thread"])
def test_rank_killed_in_a_dcp_save_falls_back_to_the_previous_checkpoint(reference, tmp_path, mode):
    root, args = tmp_path / "run", (*ARGS, "--ckpt.async_mode", mode)
    # Rank 1 dies half-way through the shard file of its second DCP save (ckpt-s10); rank 0 sees its peer gone.
    first = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, FAULT="dcp:2", FAULT_RANK="1")
    assert first[1].returncode == -signal.SIGKILL, first[1].stdout
    assert first[0].returncode != 0, first[0].stdout
    checkpoints = run_dir(root) / "checkpoints"
    assert read_pointer(checkpoints, "latest") == "ckpt-s000000000005"
    assert not (checkpoints / "ckpt-s000000000010").exists()
    rerun = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout and "ckpt-s000000000005" in rerun[0].stdout
    compare_with_reference(reference, root, tmp_path)
    assert verify_checkpoint(latest(root))["global_step"] == 30


@pytest.mark.parametrize("mode", ["disabled", "thread"])
def test_a_dcp_save_failing_on_one_rank_fails_on_every_rank_and_training_goes_on(reference, tmp_path, mode):
    root, args = tmp_path / "run", (*ARGS, "--ckpt.async_mode", mode)
    results = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, FAULT="dcp_enospc:2", FAULT_RANK="1")
    assert_all_ok(results)
    for result in results:
        assert "ckpt-s000000000010 (interval) failed" in result.stdout and "No space left on device" in result.stdout
    checkpoints = run_dir(root) / "checkpoints"
    assert not (checkpoints / "ckpt-s000000000010").exists()
    # The saves after the failed one commit (20, 25 and 30 are the three the default retention keeps).
    assert verify_checkpoint(checkpoints / "ckpt-s000000000020")["global_step"] == 20
    assert verify_checkpoint(latest(root))["global_step"] == 30
    assert_same_weights(final_weights(reference), final_weights(root))


def test_a_killed_dcp_checkpoint_process_fails_one_save_and_the_next_starts_new_ones(reference, tmp_path):
    """DCP's own checkpoint process of one rank SIGKILLed (as the out-of-memory killer would): torch never replaces
    it, so every later save failed, and the error read as state that cannot be serialized, which ended the run."""
    root, args = tmp_path / "run", (*ARGS, "--ckpt.async_mode", "process")
    processes = start_ranks(2, "resumable.py", root, *args, STEP_SLEEP="0.1")
    try:
        wait_for(root, "*/*/checkpoints/ckpt-s000000000010/manifest.json", processes)
        (checkpoint_process,) = writer_processes(processes[1].pid)  # DCP's: perdure's writer is a thread here
        os.kill(checkpoint_process, signal.SIGKILL)
        outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert [process.returncode for process in processes] == [0, 0], outputs
    assert f"DCP's checkpoint process of rank 1 (pid {checkpoint_process}) was killed by SIGKILL" in outputs[1]
    assert "DCP's checkpoint process of rank 0 failed" in outputs[0]
    assert all("next save starts a new one on every rank" in output for output in outputs)
    assert "cannot be serialized" not in "".join(outputs)
    assert verify_checkpoint(latest(root))["global_step"] == 30  # written by new checkpoint processes
    assert_same_weights(final_weights(reference), final_weights(root))


def test_a_dcp_checkpoint_process_killed_while_starting_stops_the_run_and_the_rerun_trains_on(reference, tmp_path):
    """Killed before it joined the others, DCP's process of rank 1 leaves theirs waiting in their rendezvous (torch's
    30 minutes): rank 1 stops the run at once saying so (it said its state could not be serialized), and a rerun
    starts new processes and ends like the run that never failed."""
    root, args = tmp_path / "run", (*ARGS, "--ckpt.async_mode", "process")
    processes = start_ranks(2, "resumable.py", root, *args, STEP_SLEEP="0.1")
    try:
        deadline = time.monotonic() + 120
        while not (starting := writer_processes(processes[1].pid)):  # the first save starts it, at step 5
            assert time.monotonic() < deadline and processes[1].poll() is None, "rank 1 never started DCP's process"
            time.sleep(0.005)
        os.kill(starting[0], signal.SIGKILL)  # it takes seconds to import torch: it is still starting
        output = processes[1].communicate(timeout=60)[0]  # not torch's 30 minutes
    finally:
        # As torchrun stops the other ranks once one has failed, with their process groups: rank 0's DCP process,
        # which waits for rank 1's in its rendezvous (and holds the output pipe), goes too.
        for process in processes:
            for child in writer_processes(process.pid):
                os.kill(child, signal.SIGKILL)
            process.kill()
            process.communicate(timeout=30)
    assert processes[1].returncode != 0, output
    assert "DCP's checkpoint process of rank 1 was killed by SIGKILL" in output
    assert "while it was starting" in output and "Run it again" in output
    assert "cannot be serialized" not in output
    assert_all_ok(run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT))
    assert verify_checkpoint(latest(root))["global_step"] == 30
    assert_same_weights(final_weights(reference), final_weights(root))


@pytest.mark.parametrize(("resume_ranks", "backend"), [(1, "dcp"), (4, "dcp"), (1, "auto")])
def test_dcp_checkpoint_of_two_ranks_resumes_on_another_world_size(tmp_path, resume_ranks, backend):
    root, args = tmp_path / "run", (*ARGS, "--ckpt.backend", backend)
    first = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, KILL_AT_STEP="7", SAMPLE_LOG="1",
                      LOSS_LOG=tmp_path / "first-{rank}.jsonl")  # fmt: skip
    assert all(result.returncode != 0 for result in first)
    written = verify_checkpoint(latest(root))
    assert written["name"] == "ckpt-s000000000005" and written["backend"] == "dcp" and written["world_size"] == 2

    second = run_ranks(resume_ranks, "resumable.py", root, *args, timeout=TIMEOUT, SAMPLE_LOG="1",
                       LOSS_LOG=tmp_path / "second-{rank}.jsonl")  # fmt: skip
    assert_all_ok(second)
    assert "resuming from" in second[0].stdout and "(step 5)" in second[0].stdout
    # Said once, with both world sizes and both global batches (4 per rank x 1 accumulation x ranks)
    (change,) = [line for line in second[0].stdout.splitlines() if "TOPOLOGY CHANGE" in line]
    assert f"written by 2 ranks, this attempt runs on {resume_ranks}" in change
    assert f"global batch changes from 8 to {4 * resume_ranks} samples" in change
    attempt = json.loads((run_dir(root) / "sidecar.json").read_text())["attempts"][-1]
    assert attempt["topology_change"] == {"world_size": [2, resume_ranks], "global_batch": [8, 4 * resume_ranks]}
    assert attempt["world_size"] == resume_ranks
    if resume_ranks == 4:
        assert "holds no state for rank 2" in second[2].stdout and "holds no state for rank 3" in second[3].stdout
    # `auto` on one rank writes with the file backend from then on; it read the DCP checkpoint all the same.
    manifest = verify_checkpoint(latest(root))
    assert manifest["global_step"] == 30 and manifest["world_size"] == resume_ranks
    assert manifest["backend"] == ("file" if backend == "auto" else "dcp")

    before, _ = epoch_samples(tmp_path, "first", 2, lambda step: step < 5)
    after, steps = epoch_samples(tmp_path, "second", resume_ranks, lambda step: True)
    assert min(steps) == 5 and max(steps) == 29, "training continued from the checkpoint's step"
    assert sorted(before + after) == list(range(96)), "every sample of the interrupted epoch exactly once"


def test_auto_backend_continues_a_single_process_run_on_two_ranks(tmp_path):
    root, args = tmp_path / "run", (*ARGS, "--ckpt.backend", "auto")
    assert_ok(run("resumable.py", root, *args, "--steps", "10", timeout=TIMEOUT))
    assert verify_checkpoint(latest(root))["backend"] == "file"
    second = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT)
    assert_all_ok(second)
    assert "resuming from" in second[0].stdout and "(step 10)" in second[0].stdout
    manifest = verify_checkpoint(latest(root))
    assert manifest["backend"] == "dcp" and manifest["world_size"] == 2 and manifest["global_step"] == 30


# ---- a single process -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    assert_ok(run("resumable.py", root, *ARGS, timeout=TIMEOUT, LOSS_LOG=root / "losses-0.jsonl"))
    return root


# The process mode's DCP writer is the same in one process as on two ranks: test_sigkill_of_every_rank_... has it.
@pytest.mark.parametrize("mode", ["disabled", "thread"])
def test_single_process_dcp_resume_is_bit_exact(single_reference, tmp_path, mode):
    root, args = tmp_path / "run", (*ARGS, "--ckpt.async_mode", mode)
    killed = run("resumable.py", root, *args, timeout=TIMEOUT, KILL_AT_STEP="17", STEP_SLEEP="0.01")
    assert killed.returncode == -signal.SIGKILL
    assert verify_checkpoint(latest(root))["backend"] == "dcp"
    rerun = run("resumable.py", root, *args, timeout=TIMEOUT, LOSS_LOG=tmp_path / "rerun-0.jsonl")
    assert_ok(rerun)
    compare_with_reference(single_reference, root, tmp_path, ranks=1)


def test_ema_and_fp16_scaler_resume_bit_exact_on_two_ranks(tmp_path):
    args = (*ARGS, "--ema.enabled", "true", "--precision", "fp16", "--steps", "12")
    reference, root = tmp_path / "reference", tmp_path / "run"
    assert_all_ok(run_ranks(2, "resumable.py", reference, *args, timeout=TIMEOUT))
    killed = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, KILL_AT_STEP="8")
    assert all(result.returncode != 0 for result in killed)
    assert_all_ok(run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT))
    for name in ("model.pth", "model-ema.pth"):
        assert_same_weights(final_weights(reference, name), final_weights(root, name))
    assert_same_weights(final_weights(root, "model-ema.pth"), read_dcp_weights(latest(root), ema=True))
    assert "scaler" in torch.load(latest(root) / "replicated.pth", weights_only=True)


def test_weights_read_from_a_dcp_checkpoint(single_reference, reference):
    for root in (single_reference, reference):  # written by one process and by two ranks
        exported = final_weights(root)
        assert_same_weights(exported, read_dcp_weights(latest(root)))
        assert_same_weights(exported, read_weights(run_dir(root)))  # --pretrained RUN_DIR
    with pytest.raises(Exception, match="holds no EMA weights"):
        read_dcp_weights(latest(single_reference), ema=True)


def test_ckpt_export_gathers_a_two_rank_dcp_checkpoint(reference, tmp_path, capsys):
    """`perdure ckpt export` reads DCP checkpoints in one process, without torchrun, into one full state dict."""
    from perdure.cli.main import main as perdure_cli

    capsys.readouterr()
    for target, out in ((run_dir(reference), "latest.pth"), (run_dir(reference) / "latest", "latest.safetensors")):
        assert perdure_cli(["ckpt", "export", str(target), str(tmp_path / out)]) == 0
        printed = capsys.readouterr().out
        assert "(step 30, epoch" in printed and "backend dcp" in printed
    assert_same_weights(final_weights(reference), torch.load(tmp_path / "latest.pth", weights_only=True))
    from safetensors.torch import load_file

    assert_same_weights(final_weights(reference), load_file(tmp_path / "latest.safetensors"))
    best = ["ckpt", "export", str(run_dir(reference) / "best"), str(tmp_path / "best"), "--format", "pth"]
    assert perdure_cli(best) == 0
    assert "exported model weights of" in capsys.readouterr().out and (tmp_path / "best").stat().st_size > 0


# ---- choosing the backend -------------------------------------------------------------------------------------------


def test_backend_selection():
    assert manager_class("file", 4) is FileCheckpointManager
    assert manager_class("dcp", 1) is DCPCheckpointManager
    assert manager_class("auto", 1) is FileCheckpointManager
    assert manager_class("auto", 2) is DCPCheckpointManager
    assert manager_class("deepspeed", 2) is DeepSpeedCheckpointManager
    with pytest.raises(ConfigError, match="'ckpt.backend' = 'tape'"):
        manager_class("tape", 2)


class FileRunner(ResumableRunner):
    checkpoint_manager_class = FileCheckpointManager


def test_runner_class_setting_wins_over_the_config(tmp_path):
    for cls, expected in ((ResumableRunner, DCPCheckpointManager), (FileRunner, FileCheckpointManager)):
        runner = cls(make_config(tmp_path / cls.__name__, **{"steps": 4, "ckpt.interval": 2, "ckpt.backend": "dcp"}))
        assert type(runner.checkpoints) is expected
        runner.train()
        assert verify_checkpoint(latest(tmp_path / cls.__name__))["backend"] == expected.backend


# ---- agreed coalescing of queued saves -------------------------------------------------------------------------------


class _BlockingManager:
    """Stands in for a manager: the first commit blocks until released; commits are recorded."""

    def __init__(self):
        self.release = threading.Event()
        self.committed = []

    def commit_job(self, job):
        if not self.committed:
            self.release.wait(30)
        self.committed.append(job.name)


def _job(name):
    return SaveJob(name, {}, {}, {"reason": "interval"}, is_best=False, texts={}, persistent=False)


@pytest.mark.parametrize("every_rank_agrees", [True, False])
def test_a_queued_save_is_dropped_only_when_every_rank_agrees(every_rank_agrees):
    manager = _BlockingManager()
    saver = AsyncSaver(manager, "thread")
    saver.submit(_job("a"), Snapshot({"w": torch.ones(2)}, {}))
    while saver.in_flight != "a":
        time.sleep(0.001)
    saver.submit(_job("b"), Snapshot({}, {}))  # waits behind "a"
    votes = []

    def agree(flag):
        votes.append(flag)
        return flag and every_rank_agrees  # another rank's writer may already have started "b"

    threading.Timer(0.2, manager.release.set).start()
    saver.make_room(agree=agree)
    saver.close()
    assert votes == [True]
    assert manager.committed == (["a"] if every_rank_agrees else ["a", "b"])
