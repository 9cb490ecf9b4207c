"""`grad_norm` in the train log lines on every stack: the global norm before clipping, over every shard and stage.

The same tiny GPT (no dropout, one data rank) trains its first steps on one process and split on every stack; the
norm each logs at step 1 is the norm of the same gradients, so it is the same number (to float rounding) whether the
gradients are whole, split over tensor-parallel ranks, over pipeline stages, or partitioned by DeepSpeed, and whether
the step clips them (the norm is taken before clipping) or not (then it is taken for the log lines only).
"""

from __future__ import annotations

import pytest

from perdure.loggers.metrics_csv import read_metrics_csv
from tests.runs import assert_all_ok, run_dir, run_ranks

ARGS = ("--steps", "2", "--log.interval", "1", "--ckpt.enabled", "false", "--model.dropout", "0")
NO_CLIP = ("--max_grad_norm", "0")
CLIP = ("--max_grad_norm", "0.5")
STACKS = {  # ranks, arguments
    "torch, clipped": (1, ("--stack", "torch", *CLIP)),
    "parallel tensor 2": (2, ("--stack", "parallel", "--parallel.axes.shard", "1", "--parallel.axes.tensor", "2",
                              *NO_CLIP)),
    "parallel pipeline 2, clipped": (2, ("--stack", "parallel", "--parallel.axes.shard", "1",
                                         "--parallel.axes.pipeline", "2", *CLIP)),
    "deepspeed ZeRO-2, clipped": (1, ("--stack", "deepspeed", "--deepspeed.zero_stage", "2", *CLIP)),
    "deepspeed ZeRO-0": (1, ("--stack", "deepspeed", "--deepspeed.zero_stage", "0", *NO_CLIP)),
}  # fmt: skip


def grad_norms(root) -> dict[int, float]:
    rows = read_metrics_csv(run_dir(root) / "metrics.csv")
    return {step: value for step, split, name, value in rows if split == "train" and name == "grad_norm"}


@pytest.fixture(scope="module")
def unclipped(tmp_path_factory) -> dict[int, float]:
    root = tmp_path_factory.mktemp("grad-norm-reference")
    assert_all_ok(run_ranks(1, "counted_gpt.py", root, *ARGS, "--stack", "torch", *NO_CLIP, DS_ACCELERATOR="cpu"))
    return grad_norms(root)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stack", STACKS)
def test_every_stack_logs_the_global_gradient_norm_before_clipping(tmp_path, unclipped, stack):
    ranks, args = STACKS[stack]
    root = tmp_path / "runs"
    assert_all_ok(run_ranks(ranks, "counted_gpt.py", root, *ARGS, *args, timeout=150, DS_ACCELERATOR="cpu"))
    norms = grad_norms(root)
    assert sorted(norms) == [1, 2]
    assert unclipped[1] > 0.5, "the clipped runs clip (max_grad_norm 0.5) at step 1"
    assert norms[1] == pytest.approx(unclipped[1], rel=1e-5)
