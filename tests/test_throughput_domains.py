"""tokens_per_s, samples_per_s and MFU count the data-parallel domain only, on every stack (issue 33, item 3).

Tensor, pipeline and context peers of a data rank read the same batches: they count once. Rank 0's log lines must say,
per second of `step_time`, the samples and tokens all data ranks trained (batch x data ranks x block size per step),
and MFU those tokens' FLOPs over the peak of every rank. Under 2 x 2 (FSDP x tensor) and a 2-stage pipeline the tokens
were counted once per rank: twice what was trained.
"""

from __future__ import annotations

import pytest

from perdure.loggers.metrics_csv import read_metrics_csv
from tests.runs import assert_all_ok, run_dir, run_ranks

BATCH, BLOCK, PEAK, FLOPS_PER_TOKEN = 4, 8, 1e9, 1000.0
ARGS = ("--steps", "4", "--log.interval", "2", "--ckpt.enabled", "false", "--perf.peak_flops", str(PEAK))
LAYOUTS = {  # ranks, data ranks, arguments
    "ddp": (2, 2, ("--stack", "torch")),
    "fsdp x tensor 2 x 2": (4, 2, ("--stack", "parallel", "--parallel.axes.shard", "2", "--parallel.axes.tensor", "2")),
    "pipeline 2": (2, 1, ("--stack", "parallel", "--parallel.axes.pipeline", "2", "--parallel.axes.shard", "1")),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_throughput_counts_the_data_parallel_domain(tmp_path, layout):
    ranks, data_ranks, args = LAYOUTS[layout]
    root = tmp_path / "runs"
    assert_all_ok(run_ranks(ranks, "counted_gpt.py", root, *ARGS, *args, timeout=200))
    rows = {(step, name): value for step, split, name, value in read_metrics_csv(run_dir(root) / "metrics.csv")
            if split == "train"}  # fmt: skip
    for step in (2, 4):
        per_step = rows[(step, "step_time")]
        assert rows[(step, "samples_per_s")] * per_step == pytest.approx(BATCH * data_ranks)
        assert rows[(step, "tokens_per_s")] * per_step == pytest.approx(BATCH * data_ranks * BLOCK)
        flops = rows[(step, "tokens_per_s")] * FLOPS_PER_TOKEN
        assert rows[(step, "mfu")] == pytest.approx(flops / (PEAK * ranks))
