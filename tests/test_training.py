"""The loop's own rules: non-finite steps are skipped, accumulation, evaluation bounds, the batch contract."""

from __future__ import annotations

import math

import pytest
import torch

from perdure import PerdureError
from tests.scripts.resumable import Config, ResumableRunner
from tests.scripts.resumable import make_config as resumable_config


def make_config(root, **overrides) -> Config:
    return resumable_config(root, **{"steps": 6, "ckpt.interval": 3, **overrides})


class NaNAtStep(ResumableRunner):
    """Returns a NaN loss for the second window of training."""

    def __init__(self, config):
        super().__init__(config)
        self.calls = 0

    def train_step(self, batch):
        self.calls += 1
        loss = super().train_step(batch)
        return loss * math.nan if self.calls == 2 else loss


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nonfinite_step_is_skipped_and_counted(tmp_path, precision):
    runner = NaNAtStep(make_config(tmp_path, precision=precision))
    runner.train()
    assert runner.state.skipped_steps == 1
    assert runner.global_step == 6
    assert runner.calls == 7  # one window was consumed without a step
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())


def test_nonfinite_step_is_applied_when_skipping_is_off(tmp_path):
    runner = NaNAtStep(make_config(tmp_path, skip_nonfinite_grad=False))
    runner.train()
    assert runner.state.skipped_steps == 0
    assert not all(torch.isfinite(p).all() for p in runner.model.parameters())


def test_accumulation_counts_optimizer_steps(tmp_path):
    runner = ResumableRunner(make_config(tmp_path, accum_steps=4))
    runner.train()
    assert runner.global_step == 6
    # 100 samples / batch 8 = 13 batches per epoch: windows of 4, 4, 4, 1
    assert runner.state.epoch == 1 and runner.state.samples_in_epoch == 64


def test_evaluation_reads_eval_steps_batches(tmp_path):
    runner = ResumableRunner(make_config(tmp_path, steps=40))
    assert runner.eval_batches("val") is None  # default: the whole split, whatever the budget
    full = runner.evaluate(["val"])["val"]
    assert full == runner.evaluate_steps("val")
    bounded = ResumableRunner(make_config(tmp_path / "bounded", steps=40, **{"eval.steps": 2})).evaluate(["val"])
    assert bounded["val"]["loss"] != full["loss"]
    assert runner.infer("val").shape == (40, 2)


def test_epoch_mode_evaluates_after_each_epoch(tmp_path):
    runner = ResumableRunner(make_config(tmp_path, steps=None, epochs=2))
    results = runner.train()
    assert list(results) == ["13", "26"]
    assert runner.epoch == 2
    assert runner.is_best in (True, False) and runner.best_score is not None


def test_a_batch_outside_the_default_contract_says_how_to_fix_it(tmp_path):
    runner = ResumableRunner(make_config(tmp_path))
    with pytest.raises(PerdureError, match="override train_step"):
        runner.unpack_batch(torch.zeros(3))


def test_an_async_save_that_would_not_fit_in_memory_is_made_synchronously(tmp_path, monkeypatch, caplog):
    import perdure.checkpoints.base as manager_module

    monkeypatch.setattr(manager_module, "available_memory", lambda: 1024)
    runner = ResumableRunner(make_config(tmp_path, **{"ckpt.async_mode": "thread"}))
    with caplog.at_level("WARNING", logger="perdure"):
        runner.train()
    assert "synchronously" in caplog.text and "host memory" in caplog.text
    assert runner.checkpoints.last_saved == "ckpt-s000000000006"
