"""TorchTitan-style model code on stack=parallel, used the wrong way: torch's raw error comes back with perdure's fix.
A mesh dimension by a name perdure's mesh does not have (it names them as TorchTitan does), a parallelize function
that expects TorchTitan's ParallelDims instead of a DeviceMesh, and logits left sharded by a TP plan while the loss
runs without loss parallelism."""

from __future__ import annotations

import pytest

from tests.runs import run, run_ranks

ONE_PROCESS = ("--steps", "2", "--ckpt.enabled", "false")


def test_a_mesh_dimension_by_another_name_gets_the_mesh_names(tmp_path):
    result = run("llama_run.py", tmp_path, *ONE_PROCESS, MESH_DIM="tensor")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "asked the device mesh for a dimension it does not have" in output, output[-3000:]
    assert "tp (tensor)" in output and "mesh['tp'], not mesh['tensor']" in output


def test_a_parallelize_that_expects_parallel_dims_gets_the_override_point(tmp_path):
    result = run("llama_run.py", tmp_path, *ONE_PROCESS, PARALLEL_DIMS="1")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "treated the torch DeviceMesh it was given as another object" in output, output[-3000:]
    assert "override ParallelRunner.parallelize_model(model, mesh)" in output


@pytest.mark.timeout(300)
def test_sharded_logits_without_loss_parallel_get_the_option(tmp_path):
    args = ("--parallel.axes.tensor", "2", "--parallel.axes.shard", "1", *ONE_PROCESS, "--dist.timeout", "60")
    results = run_ranks(2, "llama_run.py", tmp_path, *args, timeout=200, SHARDED_LOGITS="1")
    assert all(result.returncode != 0 for result in results)
    output = results[0].stdout
    assert "the loss mixes a DTensor" in output and "--parallel.loss_parallel true" in output, output[-3000:]
