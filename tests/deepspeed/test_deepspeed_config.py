"""The DeepSpeed engine config made from the runner's keys and the user's raw settings (no engine is built here)."""

from __future__ import annotations

import pytest

from perdure import ConfigError, RunnerConfig
from perdure.runners.deepspeed_config import engine_config
from perdure.workspace.identity import config_id


def config(**settings) -> RunnerConfig:
    made = RunnerConfig()
    made.steps, made.stack = 10, "deepspeed"
    for key, value in settings.items():
        made[key] = value
    return made


def test_the_runner_keys_decide_their_settings_over_the_raw_ones():
    raw = {"zero_optimization": {"stage": "auto", "reduce_bucket_size": 1000}, "train_micro_batch_size_per_gpu": "auto",
           "fp16": {"loss_scale_window": 50}, "steps_per_print": 10}  # fmt: skip
    made = config(**{"deepspeed.config": raw, "precision": "bf16", "accum_steps": 2, "max_grad_norm": 1.0}).check()
    settings = engine_config(made, world_size=4)
    none = {"device": "none"}
    assert settings["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000, "offload_optimizer": none,
                                             "offload_param": none}  # fmt: skip
    assert settings["train_micro_batch_size_per_gpu"] == 32 and settings["gradient_accumulation_steps"] == 2
    assert settings["train_batch_size"] == 32 * 2 * 4 and settings["gradient_clipping"] == 1.0
    assert settings["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert settings["fp16"] == {"loss_scale_window": 50, "enabled": False}
    assert settings["steps_per_print"] == 10  # a raw setting no runner key decides is kept


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"deepspeed.config": {"zero_optimization": {"stage": 3}}}, "'zero_optimization.stage=3': contradicts "
         "deepspeed.zero_stage=2"),
        ({"deepspeed.config": {"bf16": {"enabled": True}}}, "'bf16.enabled=True': contradicts precision='fp32'"),
        ({"deepspeed.config": {"train_batch_size": 64}}, "contradicts dataloader.batch_size x accum_steps x world"),
        ({"deepspeed.config": {"optimizer": {"type": "Adam"}}}, "remove the 'optimizer' section"),
        ({"deepspeed.config": {"checkpoint": {"load_universal": True}}}, "checkpoint.load_universal"),
        ({"deepspeed.zero_stage": 4}, "'deepspeed.zero_stage' = 4: use 0, 1, 2 or 3"),
        ({"deepspeed.offload_param": True}, "parameter offload needs ZeRO-3"),
        ({"deepspeed.zero_stage": 0, "deepspeed.offload_optimizer": True}, "optimizer offload needs ZeRO"),
        ({"ckpt.async_mode": "thread"}, "stack=deepspeed saves synchronously"),
        ({"ckpt.backend": "file"}, "stack=deepspeed saves through the engine"),
    ],
)  # fmt: skip
def test_a_contradiction_or_a_bad_key_is_a_config_error_naming_both(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(**settings).check()


def test_a_yaml_file_of_raw_settings_is_read(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text("zero_optimization:\n  stage: 1\n  overlap_comm: false\n")
    settings = engine_config(config(**{"deepspeed.config": str(path), "deepspeed.zero_stage": 1}).check(), 2)
    assert settings["zero_optimization"]["overlap_comm"] is False
    with pytest.raises(ConfigError, match="no such file"):
        config(**{"deepspeed.config": str(tmp_path / "missing.json")}).check()


def test_the_deepspeed_section_is_identity_only_for_the_deepspeed_stack():
    torch_stack = RunnerConfig()
    torch_stack.steps = 10
    changed = RunnerConfig()
    changed.steps, changed.deepspeed.zero_stage = 10, 3
    assert config_id(torch_stack) == config_id(changed)
    assert config_id(config(stack="ds")) == config_id(config()) != config_id(config(**{"deepspeed.zero_stage": 3}))
