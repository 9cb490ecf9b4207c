"""Bad topologies and models the parallel stack cannot split fail before anything is written, naming the key; a
SIGTERM to one rank stops every rank at the same step, saved, with exit status 143 (FSDP2, and a pipeline saving in
the background: the preemption save is drained before the exit)."""

from __future__ import annotations

import collections
import json
import re
import signal
import time

import pytest

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from tests.runs import assert_all_ok, read_losses, run, run_dir, run_ranks, start_ranks

STACK = ("--stack", "parallel", "--dist.timeout", "60")
TIMEOUT = 120

pytestmark = pytest.mark.timeout(300)


def refused(results, key, says):
    for rank, result in enumerate(results):
        assert result.returncode != 0, f"rank {rank} did not fail:\n{result.stdout}"
        output = result.stdout + (result.stderr or "")
        assert f"config key '{key}'" in output and says in output, f"rank {rank}:\n{output}"


def test_axes_whose_product_is_not_the_world_size(tmp_path):
    result = run("parallel_gpt.py", tmp_path / "runs", *STACK, "--parallel.axes.shard", "1", "--parallel.axes.tensor",
                 "2", timeout=TIMEOUT)  # fmt: skip
    refused([result], "parallel.axes", "the axes multiply to 2 but the world size is 1")
    assert "tensor=2" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_two_free_axes(tmp_path):
    result = run("parallel_gpt.py", tmp_path / "runs", *STACK, "--parallel.axes.tensor", "-1", timeout=TIMEOUT)
    refused([result], "parallel.axes", "at most one axis may be -1")
    assert not (tmp_path / "runs").exists()


def test_tensor_parallel_without_a_parallelize_method(tmp_path):
    results = run_ranks(2, "parallel_gpt.py", tmp_path / "runs", *STACK, "--parallel.axes.tensor", "2",
                        timeout=TIMEOUT, NO_PARALLELIZE="1")  # fmt: skip
    refused(results, "parallel.axes", "has no parallelize(mesh) method")
    assert not (tmp_path / "runs").exists()


def test_a_pipeline_stage_that_renames_parameters(tmp_path):
    results = run_ranks(2, "parallel_gpt.py", tmp_path / "runs", *STACK, "--parallel.axes.pipeline", "2",
                        timeout=TIMEOUT, RENAMING_STAGE="1")  # fmt: skip
    refused(results, "parallel.axes.pipeline", "must keep the whole model's names")
    assert "layers.stage0_0.attn" in results[0].stdout
    assert not (tmp_path / "runs").exists()


def test_a_train_step_override_under_pipeline_parallelism(tmp_path):
    results = run_ranks(2, "parallel_gpt.py", tmp_path / "runs", *STACK, "--parallel.axes.pipeline", "2",
                        timeout=TIMEOUT, OWN_TRAIN_STEP="1")  # fmt: skip
    refused(results, "parallel.axes.pipeline", "overrides train_step, which pipeline parallelism never calls")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "axes", [(), ("--parallel.axes.pipeline", "2", "--ckpt.async_mode", "thread")], ids=["fsdp2", "pipeline-async"]
)
def test_sigterm_to_one_rank_saves_the_same_step_on_every_rank(tmp_path, axes):
    root, log = tmp_path / "runs", tmp_path / "losses-0.jsonl"
    args = (*STACK, *axes, "--steps", "200", "--ckpt.interval", "50")
    processes = start_ranks(
        2, "parallel_gpt.py", root, *args, STEP_SLEEP="0.05", LOSS_LOG=tmp_path / "losses-{rank}.jsonl"
    )
    deadline = time.monotonic() + TIMEOUT
    while not (log.exists() and len(log.read_text().splitlines()) >= 4):
        assert time.monotonic() < deadline and all(process.poll() is None for process in processes)
        time.sleep(0.01)
    processes[1].send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    assert [process.returncode for process in processes] == [143, 143], outputs
    stopped = {int(re.search(r"checkpointing step (\d+)", output).group(1)) for output in outputs}
    assert len(stopped) == 1, f"ranks stopped at steps {stopped}"
    checkpoints = run_dir(root) / "checkpoints"
    manifest = verify_checkpoint(checkpoints / read_pointer(checkpoints, "latest"))
    assert manifest["global_step"] == stopped.pop() and manifest["reason"] == "preemption"
    assert manifest["world_size"] == 2 and manifest["topology"]["pipeline"] == (2 if axes else 1)
    assert all(f"checkpointing step {manifest['global_step']}" in output for output in outputs)


def evaluation_batches(path):
    """{step: batches} one rank's EVAL_LOG holds."""
    return collections.Counter(json.loads(line)["step"] for line in path.read_text().splitlines())


def val_rows(root):
    lines = (run_dir(root) / "metrics.csv").read_text().splitlines()[1:]
    return [line for line in lines if line.split(",")[1] == "val"]


def test_sigterm_to_one_rank_in_an_evaluation_stops_it_on_every_rank_and_the_rerun_evaluates_first(tmp_path):
    """FSDP2 runs every evaluation forward collectively, so ranks must stop an evaluation at the same batch: SIGTERM to
    rank 1 alone during the evaluation of step 5 stops both ranks there (exit 143, step 5 saved), and the rerun
    evaluates step 5 first and ends with the uninterrupted run's losses and evaluations. Every evaluation reads the
    same batches: the split's 49 samples less one, 6 batches per rank (stack=parallel used to read fewer at each
    evaluation: it sized them by the last evaluation's bound)."""
    args = (*STACK, "--steps", "10", "--ckpt.interval", "5", "--data.tokens", "4000")  # val: 49 windows
    reference = tmp_path / "reference"
    assert_all_ok(run_ranks(2, "parallel_gpt.py", reference, *args, timeout=TIMEOUT,
                            EVAL_LOG=tmp_path / "reference-eval-{rank}.jsonl",
                            LOSS_LOG=tmp_path / "reference-{rank}.jsonl"))  # fmt: skip
    for rank in range(2):
        assert evaluation_batches(tmp_path / f"reference-eval-{rank}.jsonl") == {5: 6, 10: 6}

    root, eval_log = tmp_path / "runs", tmp_path / "eval-0.jsonl"
    logs = {"EVAL_LOG": tmp_path / "eval-{rank}.jsonl", "LOSS_LOG": tmp_path / "losses-{rank}.jsonl"}
    processes = start_ranks(2, "parallel_gpt.py", root, *args, EVAL_SLEEP="0.3", **logs)
    deadline = time.monotonic() + TIMEOUT
    while not (eval_log.exists() and eval_log.read_text()):
        assert time.monotonic() < deadline and all(process.poll() is None for process in processes)
        time.sleep(0.01)
    processes[1].send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=TIMEOUT)[0] for process in processes]
    assert [process.returncode for process in processes] == [143, 143], outputs
    for rank, output in enumerate(outputs):
        assert "evaluation of step 5 stopped at batch" in output and "checkpointing step 5" in output, output
        assert evaluation_batches(tmp_path / f"eval-{rank}.jsonl")[5] < 6
    checkpoints = run_dir(root) / "checkpoints"
    manifest = verify_checkpoint(checkpoints / read_pointer(checkpoints, "latest"))
    assert (manifest["global_step"], manifest["reason"]) == (5, "preemption")

    logs = {"EVAL_LOG": tmp_path / "rerun-eval-{rank}.jsonl", "LOSS_LOG": tmp_path / "losses-{rank}.jsonl"}
    results = run_ranks(2, "parallel_gpt.py", root, *args, timeout=TIMEOUT, **logs)  # the same runner class
    assert_all_ok(results)
    for rank in range(2):
        assert evaluation_batches(tmp_path / f"rerun-eval-{rank}.jsonl") == {5: 6, 10: 6}
    assert "evaluating step 5, which the last attempt was stopped in" in results[0].stdout
    assert val_rows(root) == val_rows(reference)
    for rank in range(2):
        resumed = read_losses(tmp_path / f"losses-{rank}.jsonl")
        assert resumed == read_losses(tmp_path / f"reference-{rank}.jsonl") and len(resumed) == 10


def test_a_validation_stream_without_a_length_is_evaluated_in_lockstep(tmp_path):
    """FSDP2 runs every forward on every data rank together, so each must evaluate as many batches; a stream's count is
    not known ahead (asking for it raised TypeError at the first evaluation): the ranks agree batch by batch and stop
    when one runs out. 41 samples on 2 ranks in batches of 4: 6 and 5 batches, 5 evaluated on each."""
    args = (*STACK, "--steps", "2", "--ckpt.interval", "1", "--dataloader.batch_size", "4")
    results = run_ranks(2, "resumable.py", tmp_path / "runs", *args, timeout=TIMEOUT, VAL_SIZE="41", VAL_ITERABLE="1",
                        EVAL_LOG=tmp_path / "eval-{rank}.jsonl")  # fmt: skip
    assert_all_ok(results)
    assert "step 2/2 val: loss" in results[0].stdout
    for rank in range(2):
        assert len((tmp_path / f"eval-{rank}.jsonl").read_text().splitlines()) == 2 * 5
