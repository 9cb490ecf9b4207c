"""examples/hf_causal_lm.py: a Hugging Face LlamaForCausalLM (tiny config, random init) on padded dict batches made by
`self.collate_fns`, with the token-weighted loss, trains on DeepSpeed ZeRO-3 on 2 ranks; the export holds the
model's own parameter names, and the loss falls."""

from __future__ import annotations

import pytest

from perdure.loggers.metrics_csv import read_metrics_csv
from tests.runs import assert_all_ok, final_weights, run_dir, run_ranks

pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")


@pytest.mark.timeout(300)
def test_hf_causal_lm_trains_on_deepspeed_zero3(tmp_path):
    args = ("--stack", "deepspeed", "--deepspeed.zero_stage", "3", "--steps", "20", "--log.interval", "5")
    args += ("--ckpt.interval", "10", "--data.sequences", "96", "--dist.timeout", "60")
    assert_all_ok(run_ranks(2, "hf_causal_lm.py", tmp_path, *args, timeout=240))
    weights = final_weights(tmp_path)
    assert "model.layers.0.self_attn.q_proj.weight" in weights and "lm_head.weight" in weights
    rows = read_metrics_csv(run_dir(tmp_path) / "metrics.csv")
    train = [value for step, split, name, value in rows if (split, name) == ("train", "loss")]
    assert len(train) == 4 and train[-1] < train[0] - 0.5, train
