"""stack=deepspeed with ZeRO-3: a model built under `self.init_module()` (`deepspeed.zero.Init`) is partitioned as it is
built, so no rank ever holds it whole; it starts and trains exactly as the same model built whole (the same losses),
and a run killed on every rank and rerun ends bit-equal to the run that never stopped, EMA included (each rank
averages its own partitions; the export gathers them)."""

from __future__ import annotations

import signal

import pytest

from tests.deepspeed.conftest import TIMEOUT, args_of
from tests.runs import assert_all_ok, assert_same_weights, final_weights, read_losses, run_ranks

pytestmark = pytest.mark.timeout(400)
ARGS = args_of("zero3-ema")  # 14 steps, checkpoints at 5 and 10, ZeRO-3 in fp32 with EMA, on 2 ranks


def test_a_model_built_partitioned_trains_as_one_built_whole_and_resumes_bit_for_bit(tmp_path):
    runs = {}
    for build in ("partitioned", "eager"):
        runs[build] = run_ranks(2, "zero_init_mlp.py", tmp_path / build, *ARGS, timeout=TIMEOUT, BUILD=build,
                                LOSS_LOG=tmp_path / f"{build}-{{rank}}.jsonl")  # fmt: skip
        assert_all_ok(runs[build])
    for rank in range(2):
        assert f"rank {rank} holds 0 parameter values once the model is built" in runs["partitioned"][rank].stdout
        assert f"rank {rank} holds 0 parameter" not in runs["eager"][rank].stdout
        reference = read_losses(tmp_path / f"partitioned-{rank}.jsonl")
        assert len(reference) == 14 and reference == read_losses(tmp_path / f"eager-{rank}.jsonl")

    killed = run_ranks(2, "zero_init_mlp.py", tmp_path / "killed", *ARGS, timeout=TIMEOUT, KILL_AT_STEP="12")
    assert [result.returncode for result in killed] == [-signal.SIGKILL] * 2, [r.stdout[-2000:] for r in killed]
    rerun = run_ranks(2, "zero_init_mlp.py", tmp_path / "killed", *ARGS, timeout=TIMEOUT,
                      LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")  # fmt: skip
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout and "ckpt-s000000000010" in rerun[0].stdout, rerun[0].stdout
    for rank in range(2):
        reference, resumed = (
            read_losses(tmp_path / f"partitioned-{rank}.jsonl"),
            read_losses(tmp_path / f"rerun-{rank}.jsonl"),
        )
        assert resumed and all(reference[position] == loss for position, loss in resumed.items())
    for name in ("model.pth", "model-ema.pth"):
        assert_same_weights(final_weights(tmp_path / "partitioned", name), final_weights(tmp_path / "killed", name))
