"""The loop's own rules: non-finite steps are skipped, accumulation, evaluation bounds, the batch contract."""

from __future__ import annotations

import math

import pytest
import torch

from perdure import PerdureError
from perdure.runners.divergence import TrainingDivergedError
from perdure.workspace.sidecar import read_sidecar
from tests.scripts.resumable import Config, ResumableRunner
from tests.scripts.resumable import make_config as resumable_config


def make_config(root, **overrides) -> Config:
    return resumable_config(root, **{"steps": 6, "ckpt.interval": 3, **overrides})


class NaNAtStep(ResumableRunner):
    """Returns a NaN loss for the second window of training (with `from_then_on`, for every window after it too)."""

    from_then_on = False

    def __init__(self, config):
        super().__init__(config)
        self.calls = 0

    def train_step(self, batch):
        self.calls += 1
        loss = super().train_step(batch)
        nan = self.calls == 2 or (self.from_then_on and self.calls > 2)
        return loss * math.nan if nan else loss


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


def test_a_log_lines_norm_answers_the_check_and_a_nan_there_is_still_skipped(tmp_path, monkeypatch):
    import perdure.runners.torch_runner as torch_runner

    checks = []
    kernel = torch_runner.non_finite_check_and_unscale_
    monkeypatch.setattr(torch_runner, "non_finite_check_and_unscale_", lambda *args: checks.append(1) or kernel(*args))
    runner = ResumableRunner(make_config(tmp_path / "finite", **{"log.interval": 2}))
    runner.train()
    assert len(checks) == 3  # steps 1, 3, 5: the norm of steps 2, 4, 6 (a log line each) was finite
    checks.clear()
    runner = NaNAtStep(make_config(tmp_path / "nan", **{"log.interval": 1}))  # every step's norm is taken
    runner.train()
    assert runner.state.skipped_steps == 1 and runner.global_step == 6
    assert len(checks) == 1  # the NaN norm's step only
    assert all(torch.isfinite(p).all() for p in runner.model.parameters())


class HugeAtStep(NaNAtStep):
    """The second window's loss times 1e30: finite gradients whose 2-norm overflows float32."""

    def train_step(self, batch):
        self.calls += 1
        loss = ResumableRunner.train_step(self, batch)
        return loss * 1e30 if self.calls == 2 else loss


def test_finite_gradients_whose_norm_overflows_are_stepped(tmp_path):
    runner = HugeAtStep(make_config(tmp_path, **{"log.interval": 1}))
    steps = []
    log = runner.log_metrics
    runner.log_metrics = lambda split, metrics, step=None: (steps.append(dict(metrics)), log(split, metrics, step))
    runner.train()
    assert math.isinf(steps[1]["grad_norm"])  # the norm of step 2 overflowed ...
    assert runner.state.skipped_steps == 0 and runner.global_step == 6  # ... its finite gradients were stepped
    assert runner.calls == 6


class NaNFromStep(NaNAtStep):
    """Every step from the second on is skipped: a run whose parameters diverged."""

    from_then_on = True


def test_a_run_that_skips_every_step_stops_at_the_limit(tmp_path, capsys):
    runner = NaNFromStep(make_config(tmp_path, **{"resilience.max_consecutive_skips": 5}))
    with pytest.raises(TrainingDivergedError, match=r"^5 optimizer steps in a row had non-finite gradients \(at step "
                       r"1, 5 skipped in all\): the run has diverged"):  # fmt: skip
        runner.train()
    assert runner.calls == 6 and runner.global_step == 1
    assert read_sidecar(runner.run_dir.path / "sidecar.json")["status"] == "failed"
    assert capsys.readouterr().out.count("optimizer step skipped") == 5


def test_skips_that_are_not_in_a_row_never_stop_a_run(tmp_path):
    runner = NaNAtStep(make_config(tmp_path, **{"resilience.max_consecutive_skips": 1, "steps": 3}))
    with pytest.raises(TrainingDivergedError):  # one skip is the limit
        runner.train()
    runner = NaNAtStep(make_config(tmp_path / "two", **{"resilience.max_consecutive_skips": 2}))
    runner.train()  # one skip, then steps again: the count starts over
    assert runner.state.skipped_steps == 1 and runner.global_step == 6


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
