"""Every trainable parameter is trained, or the run refuses to start (issue 33, item 1).

Blocks wrapped in torch's `checkpoint_wrapper` the way TorchTitan's `apply_ac` does it (the wrapper replaces the block
in its container, so every parameter of the block is renamed `..._checkpoint_wrapped_module...`) train on every stack,
whoever wraps them: the program before perdure sees the model, the runner's `apply_activation_checkpointing` after the
parallel stack read the parameters (the optimizer rebuilt by name used to leave out every block: 32 of 37 tensors never
changed), or the program and perdure's own activation checkpointing together. An optimizer that leaves trainable
parameters out is refused before anything is written.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from perdure.errors import ConfigError
from perdure.runners.param_coverage import check_parameter_coverage
from perdure.runners.rebind import parameter_slots, rebuild_optimizer
from tests.runs import assert_all_ok, final_weights, run, run_ranks

CASES = {  # who wraps, ranks, arguments
    "DDP, the program wraps": ("user", 2, ("--stack", "torch")),
    "parallel, the runner's apply_activation_checkpointing wraps": ("override", 1, ("--stack", "parallel")),
    "parallel fsdp 2, the program wraps and perdure checkpoints too": (
        "user",
        2,
        ("--stack", "parallel", "--parallel.axes.shard", "2", "--parallel.activation_checkpointing", "true"),
    ),
    "deepspeed ZeRO-3, the program wraps": ("user", 1, ("--stack", "deepspeed", "--deepspeed.zero_stage", "3")),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_blocks_wrapped_in_checkpoint_wrapper_train_every_tensor(tmp_path, case):
    wrap, ranks, args = CASES[case]
    initial = tmp_path / "initial.pth"
    root = tmp_path / "runs"
    env = {"WRAP_BLOCKS": wrap, "INITIAL_WEIGHTS": initial, "DS_ACCELERATOR": "cpu"}
    assert_all_ok(run_ranks(ranks, "wrapped_blocks.py", root, *args, timeout=150, **env))
    before = torch.load(initial)
    after = final_weights(root)
    assert sorted(after) == sorted(before)
    unchanged = [name for name in before if torch.equal(before[name], after[name].to(before[name].dtype))]
    assert not unchanged, f"never trained: {unchanged}"


@pytest.mark.timeout(120)
def test_an_optimizer_that_leaves_the_blocks_out_is_refused_before_anything_is_written(tmp_path):
    root = tmp_path / "runs"
    result = run("wrapped_blocks.py", root, "--stack", "parallel", WRAP_BLOCKS="user", PARTIAL_OPTIMIZER="1")
    assert result.returncode != 0
    assert "config key 'optimizer'" in result.stdout + result.stderr
    assert "AdamW without 36 of the model's 37 trainable parameters" in result.stdout + result.stderr
    assert "tok_emb.weight, pos_emb.weight, layers.0.norm1.weight" in result.stdout + result.stderr
    assert not list(root.glob("**/ckpt-*")), "nothing is trained or saved"


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


def test_the_rebuilt_optimizer_finds_parameters_that_wrappers_renamed_and_sharding_replaced():
    model = Model()
    optimizer = torch.optim.SGD([{"params": model.layers.parameters()}, {"params": model.head.parameters(), "lr": 0.5}],
                                lr=0.1)  # fmt: skip
    slots = parameter_slots(optimizer, model)
    for index, block in enumerate(list(model.layers)):
        model.layers[index] = checkpoint_wrapper(block)  # renames: layers.0._checkpoint_wrapped_module.fc.weight
    for module in model.modules():  # what sharding does: a new parameter object in the same module
        for name, parameter in list(module._parameters.items()):
            module._parameters[name] = nn.Parameter(parameter.detach().clone())
    rebuilt = rebuild_optimizer(optimizer, slots, [model])
    blocks = [id(p) for p in model.layers.parameters()]
    assert [id(p) for p in rebuilt.param_groups[0]["params"]] == blocks
    assert [id(p) for p in rebuilt.param_groups[1]["params"]] == [id(p) for p in model.head.parameters()]
    assert rebuilt.param_groups[1]["lr"] == 0.5
    check_parameter_coverage(rebuilt, model)


def test_a_stage_copied_from_the_model_is_matched_by_name_without_the_wrappers():
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    slots = parameter_slots(optimizer, model)
    stage = Model()  # a copy: other module objects
    del stage.head
    stage.layers[1] = checkpoint_wrapper(stage.layers[1])
    rebuilt = rebuild_optimizer(optimizer, slots, [stage])
    assert [id(p) for p in rebuilt.param_groups[0]["params"]] == [id(p) for p in stage.parameters()]


def test_the_coverage_check_names_what_is_left_out_twice_or_foreign():
    model = Model()
    with pytest.raises(
        ConfigError, match=r"SGD without 2 of the model's 6 trainable parameters.*head.weight, head.bias"
    ):
        check_parameter_coverage(torch.optim.SGD(model.layers.parameters(), lr=0.1), model)
    twice = torch.optim.SGD([{"params": [model.head.weight]}], lr=0.1)
    twice.param_groups.append({**twice.param_groups[0], "params": [model.head.weight]})  # past torch's own check
    twice.param_groups[0]["params"] = list(model.parameters())
    with pytest.raises(ConfigError, match=r"holding 1 parameter\(s\) more than once.*head.weight \(groups \[0, 1\]\)"):
        check_parameter_coverage(twice, model)
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match=r"1 tensor\(s\) that are not parameters of the model.*group 0: \(3,\)"):
        check_parameter_coverage(torch.optim.SGD([*model.parameters(), stray], lr=0.1), model)
    model.head.requires_grad_(False)
    check_parameter_coverage(torch.optim.SGD(model.layers.parameters(), lr=0.1), model)  # frozen: fine
