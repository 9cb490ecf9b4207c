"""A model whose state-dict hooks rename and fuse tensors saves, resumes and exports on every backend (issue 33).

`fused_qkv.py` holds one `wqkv` projection per block and saves it, through its own state-dict hooks, as `wq` / `wk` /
`wv` (TorchTitan's and Hugging Face's fused attention do the same). DCP's `get_model_state_dict` walked the module tree
by those names and the run died at its first checkpoint; now every backend saves and loads the model through its own
hooks. Each case: a run killed after a checkpoint and rerun ends bit-equal to an uninterrupted one, and the export holds
the hooks' names.
"""

from __future__ import annotations

import re
import shutil

import pytest

from tests.runs import assert_all_ok, assert_ok, assert_same_weights, final_weights, run, run_dir, run_ranks

ARGS = ("--steps", "8", "--ckpt.interval", "3", "--log.interval", "1")
BACKENDS = {  # ranks, arguments
    "file": (1, ("--stack", "torch")),
    "dcp": (1, ("--stack", "torch", "--ckpt.backend", "dcp")),
    "parallel fsdp 2": (2, ("--stack", "parallel", "--parallel.axes.shard", "2")),
    "deepspeed": (1, ("--stack", "deepspeed", "--deepspeed.zero_stage", "3")),
}
ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fused_qkv_model_with_state_dict_hooks_resumes_bit_for_bit_and_exports(tmp_path, backend):
    ranks, args = BACKENDS[backend]
    args = (*ARGS, *args)
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert_all_ok(run_ranks(ranks, "fused_qkv.py", reference, *args, timeout=200, **ENV))
    killed = run_ranks(ranks, "fused_qkv.py", resumed, *args, timeout=200, KILL_AT_STEP="7", **ENV)
    assert all(result.returncode == -9 for result in killed), killed[0].stdout
    assert (run_dir(resumed) / "checkpoints" / "ckpt-s000000000006").is_dir()
    (rerun, *_) = run_ranks(ranks, "fused_qkv.py", resumed, *args, timeout=200, **ENV)
    assert_ok(rerun)
    assert re.search(r"resuming from \S*ckpt-s000000000006", rerun.stdout + rerun.stderr)
    expected = final_weights(reference)
    assert {"layers.0.attn.wq.weight", "layers.0.attn.wv.bias"} <= set(expected)
    assert not any("wqkv" in key for key in expected)
    assert_same_weights(final_weights(resumed), expected)
    if ranks > 1:  # the export loads into the sharded model through the hooks
        export = tmp_path / "model.pth"
        shutil.copy(run_dir(reference) / "model.pth", export)
        pretrained = ("--steps", "1", "--pretrained", str(export))
        assert_all_ok(run_ranks(ranks, "fused_qkv.py", tmp_path / "pretrained", *args, *pretrained, timeout=200))


def attempt_log(root) -> str:
    (log,) = (run_dir(root) / "logs").glob("*.log")
    return log.read_text()


@pytest.mark.timeout(120)
def test_a_state_dict_that_does_not_round_trip_stops_the_run_at_start_up_and_the_log_file_says_why(tmp_path):
    root = tmp_path / "runs"
    result = run("fused_qkv.py", root, *ARGS, "--stack", "parallel", LOSSY_LOAD="1")
    assert result.returncode != 0
    why = "the model's state dict does not come back unchanged: 8 of its entries differ after loading it back"
    assert why in result.stdout + result.stderr
    assert "layers.0.attn.wq.weight" in result.stdout + result.stderr
    assert "in layers.0.attn (FusedAttention)" in result.stdout + result.stderr
    assert why in attempt_log(root)
    assert not list(root.glob("**/ckpt-*")), "stopped before the first step"


@pytest.mark.timeout(120)
def test_an_error_that_ends_a_run_in_training_is_in_the_run_log_file(tmp_path):
    root = tmp_path / "runs"
    result = run("resumable.py", root, "--steps", "4", "--ckpt.interval", "2", UNSAVEABLE="1")
    assert result.returncode != 0
    log = attempt_log(root)
    assert "the run failed: CheckpointStateError: checkpoint ckpt-s000000000002 could not be written" in log
    assert "Traceback (most recent call last)" in log
