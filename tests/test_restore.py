"""The restore rule, the alternative constructors, and config checks that must fail before anything is written."""

from __future__ import annotations

import pytest
import torch

from perdure import CheckpointError, ConfigError, ResumeError
from tests.runs import assert_same_weights, run_dir
from tests.scripts.resumable import Config, ResumableRunner
from tests.scripts.resumable import make_config as resumable_config


def make_config(root, **overrides) -> Config:
    return resumable_config(root, **{"steps": 12, "ckpt.interval": 4, **overrides})


def train(root, **overrides) -> ResumableRunner:
    runner = ResumableRunner(make_config(root, **overrides))
    runner.train()
    return runner


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("steps", -3),
        ("steps", 2.5),
        ("accum_steps", 0),
        ("accum_steps", 65537),
        ("precision", "fp8"),
        ("stack", "jax"),
        ("checkpoint", "/nonexistent/ckpt-s000000000010"),
        ("pretrained", "/nonexistent/model.pth"),
        ("ckpt.keep_latest_k", -1),
        ("dataloader.batch_size", 0),
        ("resume", "sometimes"),
    ],
)
def test_bad_config_fails_before_writing(tmp_path, key, value):
    root = tmp_path / "runs"
    with pytest.raises(ConfigError) as error:
        ResumableRunner(make_config(root, **{key: value}))
    assert key in str(error.value)
    assert not root.exists()


def test_both_budgets_fail_before_writing(tmp_path):
    root = tmp_path / "runs"
    with pytest.raises(ConfigError, match="steps"):
        ResumableRunner(make_config(root, epochs=2))
    assert not root.exists()


def test_unknown_stack_is_refused_clearly(tmp_path):
    root = tmp_path / "runs"
    with pytest.raises(ConfigError, match="'stack' = 'jax'.*torch, parallel, deepspeed"):
        ResumableRunner(make_config(root, stack="jax"))
    assert not root.exists()


def test_resume_false_refuses_a_run_with_checkpoints(tmp_path):
    train(tmp_path)
    before = sorted(p.name for p in (run_dir(tmp_path) / "checkpoints").iterdir())
    with pytest.raises(ResumeError, match="workspace.id"):
        ResumableRunner(make_config(tmp_path, steps=20, resume=False))
    assert sorted(p.name for p in (run_dir(tmp_path) / "checkpoints").iterdir()) == before


def test_budget_reached_returns_and_larger_budget_continues(tmp_path, caplog):
    first = train(tmp_path)
    again = train(tmp_path)
    assert again.global_step == first.global_step == 12
    longer = train(tmp_path, steps=16)
    assert longer.global_step == 16
    assert (run_dir(tmp_path) / "checkpoints" / "latest").read_text().strip() == "ckpt-s000000000016"


@pytest.mark.parametrize(
    ("steps", "effect"), [(6, "Epoch 0 goes on from its sample 48"), (26, "Epoch 1 goes on from its sample 100")]
)
def test_a_train_split_that_changed_length_since_the_checkpoint_is_named_at_the_resume(
    tmp_path, monkeypatch, capsys, steps, effect
):
    train(tmp_path, steps=steps)  # 100 samples, 13 batches of 8 an epoch: step 6 is mid-epoch, 26 two whole epochs
    monkeypatch.setenv("TRAIN_EXTRA", "20")  # files added to the dataset's folder before the requeue
    capsys.readouterr()
    longer = train(tmp_path, steps=32)
    assert longer.global_step == 32, "training goes on"
    (warning,) = [line for line in capsys.readouterr().out.splitlines() if "DATASET CHANGE" in line]
    assert f"ckpt-s{steps:012d} was written when the train split had 100 samples; it has 120 now" in warning
    assert effect in warning and "give the train split back the 100 samples" in warning
    train(tmp_path, steps=36)  # the checkpoints since were written with 120: nothing changed for them
    assert "DATASET CHANGE" not in capsys.readouterr().out


def test_explicit_checkpoint_with_another_config_is_refused_with_the_diff(tmp_path):
    source = train(tmp_path / "a")
    checkpoint = run_dir(tmp_path / "a") / "checkpoints" / "ckpt-s000000000012"
    with pytest.raises(CheckpointError) as error:
        ResumableRunner(make_config(tmp_path / "b", checkpoint=str(checkpoint), **{"optim.lr": 0.5}))
    message = str(error.value)
    assert "optim.lr" in message and "0.5" in message and "--pretrained" in message
    assert not (tmp_path / "b").exists()
    assert source.global_step == 12


def test_explicit_checkpoint_starts_a_new_run_from_full_state(tmp_path):
    train(tmp_path / "a")
    checkpoint = run_dir(tmp_path / "a") / "checkpoints" / "ckpt-s000000000008"
    runner = ResumableRunner(make_config(tmp_path / "b", checkpoint=str(checkpoint)))
    assert runner.global_step == 8
    saved = torch.load(checkpoint / "state.pth", weights_only=True)["model"]
    assert_same_weights(runner.model.state_dict(), saved)


def test_own_checkpoint_wins_over_explicit_sources(tmp_path, caplog):
    train(tmp_path / "a")
    other = run_dir(tmp_path / "a") / "checkpoints" / "ckpt-s000000000004"
    train(tmp_path / "b", steps=8)
    runner = ResumableRunner(make_config(tmp_path / "b", steps=8, checkpoint=str(other)))
    assert runner.global_step == 8
    assert runner.restore_source.kind == "resume"


def test_a_training_runner_holds_its_run_dir(tmp_path):
    from perdure.resilience.run_lock import RunLockedError

    refused = []

    class Nested(ResumableRunner):
        def train_step(self, batch):
            if self.state.global_step == 2 and not refused:
                with pytest.raises(RunLockedError, match="in use by pid"):
                    ResumableRunner(config())  # a second launch fails before it builds anything
                refused.append(True)
            return super().train_step(batch)

    def config():
        return make_config(tmp_path, **{"workspace.lineage": "nested"})

    Nested(config()).train()
    assert refused
    assert ResumableRunner(config()).train()  # released at the end: the run continues (already done)


def test_from_checkpoint_rebuilds_config_and_state(tmp_path):
    trained = train(tmp_path, **{"optim.lr": 0.003})
    for path in (run_dir(tmp_path), run_dir(tmp_path) / "checkpoints", run_dir(tmp_path) / "checkpoints" / "latest"):
        target = path.parent / path.read_text().strip() if path.name == "latest" else path
        rebuilt = ResumableRunner.from_checkpoint(target, config_class=Config)
        assert rebuilt.config.optim.lr == 0.003
        assert rebuilt.global_step == trained.global_step
        assert_same_weights(rebuilt.model.state_dict(), trained.model.state_dict())
        rebuilt.close()


def test_from_pretrained_loads_weights_only(tmp_path):
    trained = train(tmp_path / "a")
    exported = run_dir(tmp_path / "a") / "model.pth"
    for source in (exported, run_dir(tmp_path / "a")):
        config = make_config(tmp_path / "b", **{"workspace.id": f"finetune-{source.name}"})
        runner = ResumableRunner.from_pretrained(config, source)
        assert runner.global_step == 0
        assert_same_weights(runner.model.state_dict(), trained.model.state_dict())


def test_disabled_checkpointing_writes_nothing_but_still_reads(tmp_path):
    disabled = train(tmp_path / "off", **{"ckpt.enabled": False})
    assert disabled.global_step == 12
    assert not list((run_dir(tmp_path / "off") / "checkpoints").iterdir())
    assert not (run_dir(tmp_path / "off") / "model.pth").exists()

    train(tmp_path / "on")
    checkpoints = run_dir(tmp_path / "on") / "checkpoints"
    before = sorted(p.name for p in checkpoints.iterdir())
    resumed = train(tmp_path / "on", steps=20, **{"ckpt.enabled": False})
    assert resumed.restore_source.kind == "resume" and resumed.global_step == 20
    assert sorted(p.name for p in checkpoints.iterdir()) == before


def test_export_dtype_casts_the_model_export(tmp_path):
    train(tmp_path, **{"ckpt.export_dtype": "bf16"})
    exported = torch.load(run_dir(tmp_path) / "model.pth", weights_only=True)
    assert all(tensor.dtype == torch.bfloat16 for tensor in exported.values())


def test_from_checkpoint_of_an_older_checkpoint_restores_exactly_it(tmp_path):
    train(tmp_path)
    original = run_dir(tmp_path)
    older = original / "checkpoints" / "ckpt-s000000000004"
    rebuilt = ResumableRunner.from_checkpoint(older, config_class=Config)
    assert rebuilt.global_step == 4
    saved = torch.load(older / "state.pth", weights_only=True)["model"]
    assert_same_weights(rebuilt.model.state_dict(), saved)
    assert rebuilt.run_dir.path != original and "from-ckpt-s000000000004" in rebuilt.run_dir.run_id
    rebuilt.close()


def test_pointer_files_are_followed_and_bad_weights_fail_before_writing(tmp_path):
    trained = train(tmp_path / "a")
    best = run_dir(tmp_path / "a") / "checkpoints" / "best"
    runner = ResumableRunner(make_config(tmp_path / "b", pretrained=str(best)))
    assert runner.global_step == 0 and runner.restore_source.kind == "pretrained"
    runner.close()
    latest = run_dir(tmp_path / "a") / "checkpoints" / "latest"
    runner = ResumableRunner(make_config(tmp_path / "c", checkpoint=str(latest)))
    assert_same_weights(runner.model.state_dict(), trained.model.state_dict())
    runner.close()

    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match="not a torch.save file"):
        ResumableRunner(make_config(tmp_path / "d", pretrained=str(garbage)))
    assert not (tmp_path / "d").exists()


def test_extending_a_run_stretches_the_schedule_over_the_new_budget(tmp_path):
    schedule = {"sched.name": "linear"}
    short = train(tmp_path / "short", **schedule)
    assert short.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    extended = ResumableRunner(make_config(tmp_path / "short", steps=24, **schedule))
    assert extended.global_step == 12
    assert extended.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5)
    extended.close()
    pinned = {**schedule, "sched.total_steps": 12}
    train(tmp_path / "pinned", **pinned)
    kept = ResumableRunner(make_config(tmp_path / "pinned", steps=24, **pinned))
    assert kept.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)
    kept.close()


def test_steps_and_epochs_runs_are_different_runs(tmp_path):
    steps = ResumableRunner(make_config(tmp_path))
    steps.close()
    epochs = ResumableRunner(make_config(tmp_path, steps=None, epochs=2))
    epochs.close()
    assert steps.run_dir.config_id != epochs.run_dir.config_id


def test_every_checkpoint_corrupt(tmp_path):
    train(tmp_path)
    for state in (run_dir(tmp_path) / "checkpoints").glob("ckpt-*/state.pth"):
        state.write_bytes(b"broken")
    with pytest.raises(ResumeError, match="refuses to start over"):
        ResumableRunner(make_config(tmp_path, resume=True))
    fresh = ResumableRunner(make_config(tmp_path))
    assert fresh.global_step == 0
    fresh.close()
