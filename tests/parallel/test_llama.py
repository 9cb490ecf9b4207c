"""examples/llama.py, a Llama-style decoder written the TorchTitan way (RMSNorm, RoPE, SwiGLU, fused QKV saved as
separate wq / wk / wv by state-dict hooks, its own TP plan, torch's checkpoint_wrapper, per-block torch.compile), on
stack=parallel: FSDP2 x TP with loss parallelism and activation checkpointing on 4 ranks, and 2 pipeline stages with
activation checkpointing and compile on 2. Each is killed at step 7 (after the checkpoint of step 5) and rerun: the
rerun ends with the same logged losses and bit-equal exported weights as an uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from perdure.loggers.metrics_csv import read_metrics_csv
from tests.runs import assert_all_ok, assert_same_weights, final_weights, run_dir, run_ranks

COMMON = ("--dist.timeout", "60")
CASES = {
    "fsdp2-tp": (
        4,
        (
            "--parallel.axes.tensor",
            "2",
            "--parallel.loss_parallel",
            "true",
            "--parallel.activation_checkpointing",
            "true",
        ),
    ),
    "pipeline": (
        2,
        ("--parallel.axes.pipeline", "2", "--parallel.activation_checkpointing", "true")
        + ("--compile.enabled", "true", "--compile.backend", "aot_eager"),
    ),
}
ENV = {"pipeline": {"NO_VAL": "1"}}  # compiled: its evaluation graphs would be compiled too (time)


def losses(root):
    rows = read_metrics_csv(run_dir(root) / "metrics.csv")
    return {step: value for step, split, name, value in rows if (split, name) == ("train", "loss")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(CASES))
def test_llama_trains_and_resumes_bit_for_bit(tmp_path, case):
    ranks, args = CASES[case]
    args, env = (*COMMON, *args), ENV.get(case, {})
    assert_all_ok(run_ranks(ranks, "llama_run.py", tmp_path / "reference", *args, timeout=240, **env))
    killed = run_ranks(ranks, "llama_run.py", tmp_path / "killed", *args, timeout=240, KILL_AT_STEP="7", **env)
    assert all(result.returncode == -9 for result in killed), [result.stdout[-2000:] for result in killed]
    rerun = run_ranks(ranks, "llama_run.py", tmp_path / "killed", *args, timeout=240, **env)
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout and "ckpt-s000000000005" in rerun[0].stdout, rerun[0].stdout
    reference = final_weights(tmp_path / "reference")
    assert_same_weights(reference, final_weights(tmp_path / "killed"))
    assert losses(tmp_path / "reference") == losses(tmp_path / "killed")
    # The export holds the checkpoint layout the hooks make (separate q / k / v), under the model's own names.
    assert "layers.0.attention.wq.weight" in reference and not any("wqkv" in key for key in reference)
    assert not any("_checkpoint_wrapped_module" in key or "_orig_mod" in key for key in reference)
    first = losses(tmp_path / "reference")
    assert first[10] < first[2] and torch.isfinite(torch.tensor(list(first.values()))).all()
