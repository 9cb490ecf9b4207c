"""torch.compile: perdure compiles in place (compile.*); checkpoints, exports and EMA hold plain parameter names, also
for a model the user compiled by hand; weights load into compiled and uncompiled models alike."""

from __future__ import annotations

import pytest
import torch

from perdure.runners.compile import plain_name, strip_compile_prefix, uncompiled
from tests.runs import assert_same_weights
from tests.scripts.resumable import ResumableRunner, make_config

PLAIN = {"0.weight", "0.bias", "3.weight", "3.bias"}  # the resumable runner's Sequential
SETTINGS = {"steps": 4, "ckpt.interval": 2, "ema.enabled": True}


class HandCompiledRunner(ResumableRunner):
    """A user who wraps the model in torch.compile themselves."""

    def __init__(self, config):
        super().__init__(config)
        self.model = torch.compile(self.model, backend="eager")


def state_file(runner, name="ckpt-s000000000004"):
    return torch.load(runner.run_dir.checkpoints / name / "state.pth", weights_only=True)


@pytest.mark.parametrize(
    "name, plain",
    [("_orig_mod.net.0.weight", "net.0.weight"), ("blocks.1._orig_mod.w", "blocks.1.w"),
     ("_orig_mod._orig_mod.x", "x"), ("net.orig_mod.w", "net.orig_mod.w")],
)  # fmt: skip
def test_plain_names(name, plain):
    assert plain_name(name) == plain
    assert list(strip_compile_prefix({name: 1})) == [plain]


def test_a_model_compiled_by_hand_is_saved_and_exported_with_plain_names(tmp_path):
    runner = HandCompiledRunner(make_config(tmp_path, **SETTINGS))
    assert "_orig_mod.0.weight" in runner.model.state_dict()  # what torch.compile's wrapper reports
    runner.train()
    state = state_file(runner)
    assert set(state["model"]) == PLAIN and set(state["ema"]["shadow"]) == PLAIN
    for export in ("model.pth", "model-ema.pth"):
        assert set(torch.load(runner.run_dir.path / export, weights_only=True)) == PLAIN
    assert runner.unwrap_model() is uncompiled(runner.model)


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    runner = ResumableRunner(make_config(root, **SETTINGS, **{"compile.enabled": True, "compile.backend": "eager"}))
    runner.train()
    return runner


def test_compile_enabled_compiles_in_place_and_keeps_plain_names(compiled_run):
    assert compiled_run.model._compiled_call_impl is not None  # compiled, not wrapped
    assert set(state_file(compiled_run)["model"]) == PLAIN
    assert set(torch.load(compiled_run.run_dir.path / "model.pth", weights_only=True)) == PLAIN


def test_a_checkpoint_of_a_compiled_model_loads_into_an_uncompiled_one_and_back(compiled_run, tmp_path):
    checkpoint = compiled_run.run_dir.checkpoints / "ckpt-s000000000004"
    saved = state_file(compiled_run)["model"]
    plain = ResumableRunner(make_config(tmp_path / "plain", **SETTINGS, checkpoint=str(checkpoint)))
    assert plain.model._compiled_call_impl is None and plain.global_step == 4
    assert_same_weights(plain.model.state_dict(), saved)
    plain.config.steps = 6
    plain.train()  # trains on from the compiled run's state, uncompiled
    plain_checkpoint = plain.run_dir.checkpoints / "ckpt-s000000000006"
    by_hand = HandCompiledRunner(make_config(tmp_path / "hand", **SETTINGS, checkpoint=str(plain_checkpoint)))
    assert by_hand.global_step == 6
    assert_same_weights(by_hand.unwrap_model().state_dict(), state_file(plain, plain_checkpoint.name)["model"])
    by_hand.close()


def test_pretrained_weights_with_or_without_the_prefix_load_into_either_model(compiled_run, tmp_path):
    plain_weights = torch.load(compiled_run.run_dir.path / "model.pth", weights_only=True)
    prefixed = tmp_path / "prefixed.pth"
    torch.save({f"_orig_mod.{key}": value for key, value in plain_weights.items()}, prefixed)
    for runner_class, weights in ((ResumableRunner, prefixed), (HandCompiledRunner, compiled_run.run_dir.path)):
        runner = runner_class(make_config(tmp_path / runner_class.__name__, **SETTINGS, pretrained=str(weights)))
        assert_same_weights(runner.unwrap_model().state_dict(), plain_weights)
        runner.close()
