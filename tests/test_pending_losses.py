"""Losses carried over a resume (issue 9): RunnerState holds plain numbers, so a checkpoint's pending losses never meet
the run's own loss tensors on another device or in another dtype; a resumed run logs the averages a run that never
stopped logs. On CUDA the old tensors came back on the CPU and `torch.stack` failed at the first log line; here the
mismatch is simulated with checkpoints that carry the losses as float64 tensors (another dtype) or meta tensors
(another device). A restored RunnerState field of a type or value the state never holds (a checkpoint from someone
else) is refused, naming it, before training."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from perdure import CheckpointError, CheckpointPolicy, FileCheckpointManager
from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from perdure.loggers.metrics_csv import read_metrics_csv
from perdure.runners.losses import losses_as_floats, mean_loss
from perdure.runners.state import RunnerState
from tests.runs import assert_same_weights, final_weights, run_dir
from tests.scripts.resumable import ResumableRunner, make_config

# Saves every 3 steps and logs every 4: the checkpoint of step 6 carries the losses of steps 5 and 6.
SETTINGS = {"ckpt.interval": 3, "log.interval": 4}


def train(root: Path, steps: int) -> ResumableRunner:
    runner = ResumableRunner(make_config(root, steps=steps, **SETTINGS))
    runner.train()
    return runner


def tensors_in(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    return []


def latest(root: Path) -> Path:
    checkpoints = run_dir(root) / "checkpoints"
    return checkpoints / read_pointer(checkpoints, "latest")


def train_losses(root: Path) -> list[tuple[int, float]]:
    rows = read_metrics_csv(run_dir(root) / "metrics.csv")
    return [(step, value) for step, split, name, value in rows if split == "train" and name == "loss"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reference")
    train(root, 12)
    return root


class Saved:
    """A Stateful handing over what a checkpoint held, to write it again in another form."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        raise AssertionError("only saved")


def rewrite_pending_losses(root: Path, convert, key: str = "pending_losses") -> None:
    """Commit the latest checkpoint again, identical but for its pending losses (or another field of the runner's
    state), through the real commit protocol."""
    path = latest(root)
    manifest = verify_checkpoint(path)
    replicated = torch.load(path / "state.pth", weights_only=True)
    local = torch.load(path / "rank00000.pth", weights_only=True)
    config_text = (path / "config.yaml").read_text()
    replicated["state"][key] = convert(replicated["state"][key])
    shutil.rmtree(path)
    identity = {key: manifest[key] for key in ("config_id", "code_id")}
    manager = FileCheckpointManager(path.parent, CheckpointPolicy(), identity=identity)
    meta = {key: manifest[key] for key in ("global_step", "epoch", "samples_in_epoch", "reason", "score")}
    manager.save(path.name, {key: Saved(value) for key, value in replicated.items()},
                 {key: Saved(value) for key, value in local.items()}, meta=meta,
                 texts={"config.yaml": config_text})  # fmt: skip


def test_a_resumed_run_carries_pending_losses_as_numbers_and_logs_the_same(reference, tmp_path):
    first = train(tmp_path, 6)
    assert tensors_in(first.state.state_dict()) == [] and tensors_in(vars(first.state)) == []
    saved = torch.load(latest(tmp_path) / "state.pth", weights_only=True)["state"]
    assert tensors_in(saved) == [] and len(saved["pending_losses"]) == 2
    assert all(type(loss) is float for loss in saved["pending_losses"])

    resumed = ResumableRunner(make_config(tmp_path, steps=12, **SETTINGS))
    assert resumed.global_step == 6 and tensors_in(vars(resumed.state)) == []
    assert resumed._losses == saved["pending_losses"]
    resumed.train()
    assert train_losses(tmp_path)[-2:] == train_losses(reference)[-2:]  # steps 8 (steps 5-8) and 12
    assert [step for step, _ in train_losses(tmp_path)] == [4, 8, 12]
    assert_same_weights(final_weights(reference), final_weights(tmp_path))


def test_an_older_checkpoint_holding_loss_tensors_of_another_dtype_resumes_and_logs_the_same(reference, tmp_path):
    train(tmp_path, 6)
    rewrite_pending_losses(tmp_path, lambda losses: [torch.tensor(loss, dtype=torch.float64) for loss in losses])
    resumed = ResumableRunner(make_config(tmp_path, steps=12, **SETTINGS))
    assert tensors_in(vars(resumed.state)) == [] and all(type(loss) is float for loss in resumed._losses)
    resumed.train()
    # A float64 mean would differ from the float32 mean the uninterrupted run logged.
    assert train_losses(tmp_path)[-2:] == train_losses(reference)[-2:]


def test_losses_restored_on_another_device_are_refused_before_training(tmp_path):
    train(tmp_path, 6)
    rewrite_pending_losses(tmp_path, lambda losses: [torch.empty((), device="meta") for _ in losses])
    with pytest.raises(CheckpointError, match=r"state\.pending_losses\[0\] is a tensor of shape \(\) on meta"):
        ResumableRunner(make_config(tmp_path, steps=12, **SETTINGS))


def test_runner_state_turns_tensors_into_numbers_both_ways():
    state = RunnerState(pending_losses=[torch.tensor(0.5), 0.25])
    state.results = {"3": {"val": {"loss": torch.tensor(1.5), "accuracy": 0.75}}}
    state.best_score = torch.tensor(1.5)
    plain = state.state_dict()
    assert tensors_in(plain) == []
    assert plain["pending_losses"] == [0.5, 0.25] and plain["results"]["3"]["val"] == {"loss": 1.5, "accuracy": 0.75}
    loaded = RunnerState()
    loaded.load_state_dict({"pending_losses": [torch.tensor(0.125, dtype=torch.bfloat16)], "best_score": 2.0})
    assert loaded.pending_losses == [0.125] and type(loaded.pending_losses[0]) is float
    for bad, message in ([torch.ones(2)], r"shape \(2,\)"), (["0.5"], "not a number"), (0.5, "not a list"):
        with pytest.raises(CheckpointError, match=message):
            RunnerState().load_state_dict({"pending_losses": bad})


def test_the_log_mean_of_carried_floats_and_new_tensors_equals_the_uninterrupted_mean():
    generator = torch.Generator().manual_seed(0)
    losses = list(torch.rand(7, generator=generator, dtype=torch.float32).unbind())
    for dtype in (torch.float32, torch.bfloat16):
        typed = [loss.to(dtype) for loss in losses]
        uninterrupted = torch.stack(typed).mean().item()
        for carried in range(len(typed)):  # a log line follows a step: at least one loss is the run's own
            resumed = losses_as_floats(typed[:carried]) + typed[carried:]
            assert mean_loss(resumed) == uninterrupted, (dtype, carried)


BAD_FIELDS = [
    ("global_step", "12", "not a non-negative integer"),
    ("samples_in_epoch", -3, "not a non-negative integer"),
    ("epoch", 1.0, "not a non-negative integer"),
    ("best_step", True, "not a non-negative integer"),
    ("evaluation_pending", 1, "not true or false"),
    ("early_stopped", "no", "not true or false"),
    ("best_score", float("nan"), "not a number"),
    ("best_score", "0.5", "not a number"),
    ("wandb_run_id", "../../etc", "not a W&B run id"),
    ("results", [], "not a mapping of steps"),
    ("results", {"latest": {}}, "not step"),
    ("results", {"3": {"val": {"loss": "low"}}}, "not a number"),
    ("results", {"3": {"val": [0.5]}}, "not split"),
]


@pytest.mark.parametrize(("key", "bad", "message"), BAD_FIELDS, ids=[f"{key}={bad!r}" for key, bad, _ in BAD_FIELDS])
def test_a_restored_state_field_of_another_type_is_refused_and_nothing_changes(key, bad, message):
    state = RunnerState(global_step=7, best_score=1.5)
    with pytest.raises(CheckpointError, match=rf"state\.{key}\b.*{message}"):
        state.load_state_dict({"global_step": 9, "best_score": 0.5, key: bad})
    assert (state.global_step, state.best_score) == (7, 1.5), "a refused state changed the run's"


def test_every_field_a_run_saves_is_taken_back():
    state = RunnerState(global_step=12, epoch=1, samples_in_epoch=40, attempt=2, skipped_steps=1, best_score=0.25,
                        best_step=10, patience_count=1, early_stopped=True, wandb_run_id="a1b2c3d4",
                        evaluation_pending=True, pending_losses=[0.5])  # fmt: skip
    state.results = {"10": {"val": {"loss": 0.25, "accuracy": 1}}}
    loaded = RunnerState()
    loaded.load_state_dict(state.state_dict())
    assert loaded == state


def test_a_checkpoint_whose_step_is_not_a_number_is_refused_before_training(tmp_path):
    train(tmp_path, 6)
    rewrite_pending_losses(tmp_path, lambda step: str(step), key="global_step")
    with pytest.raises(CheckpointError, match=r"state\.global_step is '6', not a non-negative integer"):
        ResumableRunner(make_config(tmp_path, steps=12, **SETTINGS))
