"""The user's own objects in checkpoints (`self.checkpointed`): refused early when they cannot be saved, listed in the
manifest, and a restore that leaves one alone says so. (Kill -9 + rerun bit-exact with one: test_resume.)"""

from __future__ import annotations

import json
import os

import pytest
import torch

from perdure import PerdureError
from perdure.checkpoints.commit import read_manifest
from perdure.errors import CheckpointCorruptError
from tests.runs import run_dir
from tests.scripts.resumable import MomentumTeacher, ResumableRunner, make_config


class Counter:
    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class WithCounter(ResumableRunner):
    """Counts its optimizer steps in an object of its own, registered under `NAME`."""

    NAME = "counter"

    def __init__(self, config):
        super().__init__(config)
        self.counter = Counter()
        self.checkpointed[self.NAME] = self.counter

    def optimizer_step(self):
        stepped = super().optimizer_step()
        self.counter.count += int(stepped)
        return stepped


def config(root, steps=8):
    # One lineage for every class here: the same run whichever runner continues it.
    return make_config(root, steps=steps, **{"ckpt.interval": 4, "workspace.lineage": "user-state"})


def test_checkpoint_lists_and_restores_the_users_objects(tmp_path):
    runner = WithCounter(config(tmp_path))
    runner.train()
    manifest = read_manifest(run_dir(tmp_path) / "checkpoints" / "ckpt-s000000000008")
    assert manifest["states"] == ["state", "model", "optimizer", "counter"]

    resumed = WithCounter(config(tmp_path, steps=12))
    assert resumed.counter.count == 8  # restored before training goes on
    resumed.train()
    assert resumed.counter.count == 12


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("model", Counter(), "the runner saves an object of its own as 'model'; choose another name, e.g. 'my_model'"),
        ("rng", Counter(), "the runner saves an object of its own as 'rng'"),
        ("teacher.net", Counter(), "a name is a Python identifier"),
        ("", Counter(), "a name is a Python identifier"),
        (3, Counter(), "a name is a Python identifier"),
        ("count", 3, "an object of type int has no state_dict() or load_state_dict()"),
        ("generator", iter([]), "has no state_dict() or load_state_dict()"),
    ],
)
def test_an_object_that_cannot_be_checkpointed_is_refused_at_setup(tmp_path, name, value, message):
    class Bad(ResumableRunner):
        def __init__(self, config):
            super().__init__(config)
            self.checkpointed[name] = value

    root = tmp_path / "runs"
    with pytest.raises(PerdureError) as error:
        Bad(config(root))
    assert message in str(error.value)
    assert f"self.checkpointed[{name!r}]" in str(error.value)
    # A failed setup, recorded as such (`perdure runs ls` shows it with this error), before any training or save.
    assert not list(root.glob("*/*/checkpoints/ckpt-*"))


def test_a_stack_name_taken_at_save_time_is_refused(tmp_path):
    class Extra(WithCounter):  # a stack that saves "counter" itself (DeepSpeed's engine, TorchFT's progress ...)
        def extra_states(self):
            return {**super().extra_states(), "counter": Counter()}

    with pytest.raises(PerdureError, match="saves an object of its own as 'counter'"):
        Extra(config(tmp_path)).train()


def test_a_restore_says_which_objects_it_leaves_alone(tmp_path, capsys):
    ResumableRunner(config(tmp_path)).train()  # code that saves no counter
    capsys.readouterr()
    added = WithCounter(config(tmp_path, steps=12))  # the same run, now with one
    out = capsys.readouterr().out
    assert added.counter.count == 0
    assert "holds no 'counter': the code that wrote it did not save it, so it keeps the state this run built" in out
    added.train()
    assert added.counter.count == 4

    capsys.readouterr()
    ResumableRunner(config(tmp_path, steps=16))  # and without it again
    out = capsys.readouterr().out
    assert "ckpt-s000000000012 holds 'counter', which this runner does not save or restore: not read" in out


def test_a_checkpoint_whose_manifest_lists_no_objects_is_read_without_a_word(tmp_path, capsys):
    ResumableRunner(config(tmp_path)).train()
    path = run_dir(tmp_path) / "checkpoints" / "ckpt-s000000000008" / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["states"]  # as written before manifests listed them
    os.chmod(path, 0o644)
    path.write_text(json.dumps(manifest))
    capsys.readouterr()
    runner = WithCounter(config(tmp_path, steps=12))
    assert runner.state.global_step == 8
    assert "holds no" not in capsys.readouterr().out


@pytest.mark.parametrize("states", ["model", [1, 2], ["x" * 65], ["model"] * 1025])
def test_a_malformed_list_of_objects_makes_the_manifest_corrupt(tmp_path, states):
    ResumableRunner(config(tmp_path)).train()
    checkpoint = run_dir(tmp_path) / "checkpoints" / "ckpt-s000000000008"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["states"] = states
    os.chmod(checkpoint / "manifest.json", 0o644)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointCorruptError, match="'states'"):
        read_manifest(checkpoint)


def test_the_teacher_of_the_resume_tests_changes_with_every_step():
    # test_resume compares it after a kill: it must not be a state a fresh start would also end in.
    model = torch.nn.Linear(2, 2)
    teacher = MomentumTeacher(model)
    before = {key: value.clone() for key, value in teacher.state_dict()["net"].items()}
    torch.nn.init.ones_(model.weight)
    teacher.update(model)
    assert teacher.updates == 1
    assert not torch.equal(teacher.net.weight, before["weight"])
    assert teacher.center.abs().sum() > 0
