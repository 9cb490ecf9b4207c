"""DDP with the file backend on CPU / gloo: kills of every rank, a signal to one rank, and resumes on another number
of ranks. Ranks are started as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR / PORT)."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
import torch

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from tests.runs import assert_all_ok, assert_same_weights, final_weights, read_losses, run_dir, run_ranks, start_ranks

ARGS = ("--steps", "30", "--ckpt.interval", "5", "--ckpt.backend", "file")
ARGS += ("--dataset_size", "96", "--dataloader.batch_size", "4")

pytestmark = pytest.mark.timeout(300)


def wait_for(path_glob_root, pattern, processes, timeout=120):
    deadline = time.monotonic() + timeout
    while not list(path_glob_root.glob(pattern)):
        for process in processes:
            assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    assert_all_ok(run_ranks(2, "resumable.py", root, *ARGS, LOSS_LOG=str(root / "losses-{rank}.jsonl")))
    return root


def compare_with_reference(reference, root, logs):
    for rank in range(2):
        expected = read_losses(reference / f"losses-{rank}.jsonl")
        resumed = read_losses(logs / f"rerun-{rank}.jsonl")
        assert resumed and min(resumed) > (0, 0, 0)
        for position, loss in resumed.items():
            assert expected[position] == loss, f"rank {rank}: loss at {position} differs"
    assert_same_weights(final_weights(reference), final_weights(root))


def test_sigkill_of_every_rank_and_rerun_is_bit_exact(reference, tmp_path):
    root = tmp_path / "run"
    processes = start_ranks(2, "resumable.py", root, *ARGS, STEP_SLEEP="0.02")
    wait_for(root, "*/*/checkpoints/ckpt-s000000000010/manifest.json", processes)
    for process in processes:
        process.send_signal(signal.SIGKILL)
    for process in processes:
        process.communicate(timeout=60)
        assert process.returncode == -signal.SIGKILL
    assert not (run_dir(root) / "model.pth").exists()
    assert_all_ok(run_ranks(2, "resumable.py", root, *ARGS, LOSS_LOG=str(tmp_path / "rerun-{rank}.jsonl")))
    compare_with_reference(reference, root, tmp_path)


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(reference, tmp_path):
    """A log line every 4 steps: past the first one, the steps being short, the ranks agree on the signal one step
    after rank 1 received it (the pipelined stop check, tests/distributed/test_stop_agreement.py)."""
    root = tmp_path / "run"
    log = tmp_path / "first-{rank}.jsonl"
    lines = ("--log.interval", "4")
    processes = start_ranks(2, "resumable.py", root, *ARGS, *lines, STEP_SLEEP="0.03", LOSS_LOG=str(log))
    first_log = tmp_path / "first-0.jsonl"
    deadline = time.monotonic() + 120
    while not (first_log.exists() and len(first_log.read_text().splitlines()) >= 12):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    processes[1].send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [143, 143], outputs
    stopped = int(re.search(r"checkpointing step (\d+)", outputs[0]).group(1))
    checkpoints = run_dir(root) / "checkpoints"
    latest = checkpoints / read_pointer(checkpoints, "latest")
    manifest = verify_checkpoint(latest)
    assert manifest["global_step"] == stopped and manifest["world_size"] == 2
    assert {"rank00000.pth", "rank00001.pth"} <= set(manifest["files"])
    assert_all_ok(run_ranks(2, "resumable.py", root, *ARGS, *lines, LOSS_LOG=str(tmp_path / "rerun-{rank}.jsonl")))
    compare_with_reference(reference, root, tmp_path)


@pytest.mark.parametrize("resume_ranks", [1, 4])
def test_resume_on_another_world_size_sees_every_sample_once(tmp_path, resume_ranks):
    root = tmp_path / "run"
    first = run_ranks(2, "resumable.py", root, *ARGS, KILL_AT_STEP="7", SAMPLE_LOG="1",
                      LOSS_LOG=str(tmp_path / "first-{rank}.jsonl"))  # fmt: skip
    assert all(result.returncode != 0 for result in first)
    checkpoints = run_dir(root) / "checkpoints"
    assert read_pointer(checkpoints, "latest") == "ckpt-s000000000005"

    second = run_ranks(resume_ranks, "resumable.py", root, *ARGS, SAMPLE_LOG="1",
                       LOSS_LOG=str(tmp_path / "second-{rank}.jsonl"))  # fmt: skip
    assert_all_ok(second)
    if resume_ranks == 4:
        assert "holds no state for rank 2" in second[2].stdout

    def samples(prefix, ranks, keep):
        seen = []
        for rank in range(ranks):
            for line in (tmp_path / f"{prefix}-{rank}.jsonl").read_text().splitlines():
                record = json.loads(line)
                if record["epoch"] == 0 and keep(record["step"]):
                    seen.extend(record["samples"])
        return seen

    # Batches of steps 0-4 were committed by the checkpoint at step 5; later ones were lost with the kill.
    before = samples("first", 2, lambda step: step < 5)
    after = samples("second", resume_ranks, lambda step: True)
    assert len(before) == 5 * 2 * 4
    assert sorted(before + after) == list(range(96)), "every sample of the interrupted epoch exactly once"
    sidecar = json.loads((run_dir(root) / "sidecar.json").read_text())
    assert sidecar["status"] == "completed" and sidecar["step"] == 30


def test_ddp_with_compile_killed_and_rerun_matches_the_uncompiled_run_bit_for_bit(reference, tmp_path):
    """compile.enabled on two ranks: the model is compiled in place before DDP wraps it; with the `eager` backend
    (the same kernels as eager mode) a SIGKILLed and rerun compiled run ends where the uncompiled reference does."""
    args = (*ARGS, "--compile.enabled", "--compile.backend", "eager")
    killed = run_ranks(2, "resumable.py", tmp_path, *args, KILL_AT_STEP="13")
    assert [result.returncode for result in killed] == [-signal.SIGKILL, -signal.SIGKILL]
    assert read_pointer(run_dir(tmp_path) / "checkpoints", "latest") == "ckpt-s000000000010"
    assert_all_ok(run_ranks(2, "resumable.py", tmp_path, *args, LOSS_LOG=str(tmp_path / "rerun-{rank}.jsonl")))
    compare_with_reference(reference, tmp_path, tmp_path)
    state = torch.load(run_dir(tmp_path) / "checkpoints" / "ckpt-s000000000030" / "state.pth", weights_only=True)
    assert not [name for name in state["model"] if "_orig_mod" in name or name.startswith("module.")]


def test_sigterm_to_one_rank_in_an_evaluation_of_a_stream_stops_every_rank_there(tmp_path):
    """A validation stream without a length, shared unevenly (41 samples: 21 and 20, 6 and 5 batches of 4): no rank
    knows ahead how many batches the others hold, so before each batch the ranks agree whether to go on and whether a
    signal arrived. SIGTERM to rank 1 alone in the evaluation of step 5 stops both there (exit 143); the rerun
    evaluates step 5 first and ends with the uninterrupted run's losses, weights and evaluations, every one of which
    read all 41 samples."""
    args = ("--steps", "10", "--ckpt.interval", "5", "--dataset_size", "48", "--dataloader.batch_size", "4")
    stream = {"VAL_SIZE": "41", "VAL_ITERABLE": "1"}
    reference = tmp_path / "reference"
    assert_all_ok(run_ranks(2, "resumable.py", reference, *args, **stream, LOSS_LOG=reference / "losses-{rank}.jsonl",
                            EVAL_LOG=tmp_path / "reference-eval-{rank}.jsonl"))  # fmt: skip
    evaluated = [len((tmp_path / f"reference-eval-{rank}.jsonl").read_text().splitlines()) for rank in range(2)]
    assert evaluated == [2 * 6, 2 * 5]

    root, eval_log = tmp_path / "run", tmp_path / "eval-0.jsonl"
    processes = start_ranks(
        2, "resumable.py", root, *args, **stream, EVAL_SLEEP="0.3", EVAL_LOG=tmp_path / "eval-{rank}.jsonl"
    )
    deadline = time.monotonic() + 120
    while not (eval_log.exists() and eval_log.read_text()):
        assert time.monotonic() < deadline and all(process.poll() is None for process in processes)
        time.sleep(0.01)
    processes[1].send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [143, 143], outputs
    stopped_at = {re.search(r"evaluation of step 5 stopped at batch (\d+)", output).group(1) for output in outputs}
    assert len(stopped_at) == 1, outputs
    assert verify_checkpoint(run_dir(root) / "checkpoints" / "ckpt-s000000000005")["reason"] == "preemption"

    rerun = run_ranks(2, "resumable.py", root, *args, **stream, LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")
    assert_all_ok(rerun)
    assert "evaluating step 5, which the last attempt was stopped in" in rerun[0].stdout
    compare_with_reference(reference, root, tmp_path)
    rows = [(run_dir(path) / "metrics.csv").read_text().splitlines() for path in (reference, root)]
    assert [line for line in rows[0] if ",val," in line] == [line for line in rows[1] if ",val," in line]


@pytest.mark.parametrize("stack", ["torch", "parallel"], ids=["ddp", "fsdp2"])
def test_a_non_finite_step_on_one_rank_is_skipped_by_every_rank(tmp_path, stack):
    """DDP averages a NaN of one rank into every rank's gradients, so each rank skips on its own (no collective);
    FSDP2's ranks each check their own shards and agree in one all-reduce, which carries the stop signal too."""
    root = tmp_path / "runs"
    args = ("--stack", stack, "--steps", "6", "--ckpt.interval", "6", "--log.interval", "2")
    results = run_ranks(2, "resumable.py", root, *args, "--dataset_size", "96", NAN_AT_STEP="3", NAN_RANK="1")
    assert_all_ok(results)
    for result in results:  # rank 0 computed finite gradients of its own: the skip was agreed
        assert "non-finite gradients at step 3: optimizer step skipped (1 skipped so far)" in result.stdout
    assert verify_checkpoint(latest_checkpoint(root))["global_step"] == 6
    assert all(torch.isfinite(tensor).all() for tensor in final_weights(root).values())


def latest_checkpoint(root):
    checkpoints = run_dir(root) / "checkpoints"
    return checkpoints / read_pointer(checkpoints, "latest")
