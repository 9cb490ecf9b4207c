"""Bad topologies and models the parallel stack cannot split fail before anything is written, naming the key; a
SIGTERM to one rank stops every rank at the same step, saved, with exit status 143 (FSDP2, and a pipeline saving in
the background: the preemption save is drained before the exit)."""

from __future__ import annotations

import re
import signal
import time

import pytest

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from tests.runs import run, run_dir, run_ranks, start_ranks

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
