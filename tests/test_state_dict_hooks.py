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

from tests.runs import assert_ok, assert_same_weights, final_weights, run, run_dir

ARGS = ("--steps", "8", "--ckpt.interval", "3", "--log.interval", "1")
BACKENDS = {
    "file": ("--stack", "torch"),
    "dcp": ("--stack", "torch", "--ckpt.backend", "dcp"),
    "parallel": ("--stack", "parallel"),
    "deepspeed": ("--stack", "deepspeed", "--deepspeed.zero_stage", "3"),
}
ENV = {"DS_ACCELERATOR": "cpu"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fused_qkv_model_with_state_dict_hooks_resumes_bit_for_bit_and_exports(tmp_path, backend):
    args = (*ARGS, *BACKENDS[backend])
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    assert_ok(run("fused_qkv.py", reference, *args, **ENV))
    killed = run("fused_qkv.py", resumed, *args, KILL_AT_STEP="7", **ENV)
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert (run_dir(resumed) / "checkpoints" / "ckpt-s000000000006").is_dir()
    rerun = run("fused_qkv.py", resumed, *args, **ENV)
    assert_ok(rerun)
    assert re.search(r"resuming from \S*ckpt-s000000000006", rerun.stdout + rerun.stderr)
    expected = final_weights(reference)
    assert {"layers.0.attn.wq.weight", "layers.0.attn.wv.bias"} <= set(expected)
    assert not any("wqkv" in key for key in expected)
    assert_same_weights(final_weights(resumed), expected)
    if backend == "parallel":  # the export loads into the sharded model through the hooks
        export = tmp_path / "model.pth"
        shutil.copy(run_dir(reference) / "model.pth", export)
        assert_ok(run("fused_qkv.py", tmp_path / "pretrained", *args, "--steps", "1", "--pretrained", str(export)))
