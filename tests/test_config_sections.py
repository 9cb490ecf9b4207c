"""Registered config sections (`config_checks.register_section`): a section's keys, defaults, help and plain
validation are declared by the module that owns it (`parallel` by distributed/topology.py, `deepspeed` by
runners/deepspeed_config.py, `ft` by ft/config.py), and `RunnerConfig` holds them: a new stack with keys of its own
edits no shared file."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from perdure import ConfigError, RunnerConfig
from perdure.config_checks import (
    SectionKey,
    register_section,
    register_stack,
    section_checks,
    section_keys,
    section_stacks,
    sections,
    stack_names,
)
from perdure.config_help import key_help
from perdure.plain import flatten
from perdure.runners.runner import stack_class
from perdure.runners.torch_runner import TorchRunner
from perdure.workspace.identity import config_id
from tests.test_import_cycles import ROOT

BUILT_IN = ["deepspeed", "ft", "parallel"]


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    import perdure.config_checks

    monkeypatch.setattr(perdure.config_checks, "_SECTIONS", dict(perdure.config_checks._SECTIONS))
    monkeypatch.setattr(perdure.config_checks, "_SECTION_CHECKS", dict(perdure.config_checks._SECTION_CHECKS))
    monkeypatch.setattr(perdure.config_checks, "_SECTION_STACKS", dict(perdure.config_checks._SECTION_STACKS))
    monkeypatch.setattr(perdure.config_checks, "_STACKS", dict(perdure.config_checks._STACKS))


def test_the_built_in_sections_are_declared_by_their_modules() -> None:
    assert list(sections()) == BUILT_IN
    keys = flatten(RunnerConfig().to_plain())
    declared = section_keys()
    assert set(declared) == {key for key in keys if key.split(".")[0] in BUILT_IN}
    # after perdure's own keys, in the declared order
    assert list(keys)[-len(declared) :] == list(declared)
    assert all(keys[key] == d.default for key, d in declared.items())
    helps = key_help(RunnerConfig)
    assert all(helps[key] == d.help and d.help for key, d in declared.items())


def test_the_built_in_stacks_are_registered_in_their_order() -> None:
    assert stack_names() == ("torch", "parallel", "deepspeed", "ds")
    assert section_stacks() == {"deepspeed": "deepspeed"}
    config = RunnerConfig()
    config.steps = 1
    config.stack = "jax"
    with pytest.raises(ConfigError, match="use one of: torch, parallel, deepspeed, ds"):
        config.check()


def test_a_config_built_from_the_config_module_alone_holds_the_sections() -> None:
    program = textwrap.dedent(
        """
        from perdure.config import RunnerConfig
        config = RunnerConfig()
        print(config.parallel.axes.shard, config.ft.timeout, config.deepspeed.zero_stage)
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["-1", "60.0", "2"]


def test_a_new_section_needs_no_shared_file(isolated_registry: None) -> None:
    def check_mystack(config: RunnerConfig, get) -> None:
        if get("mystack.width") > 8 and get("mystack.mode") == "slim":
            raise ConfigError("mystack.width", get("mystack.width"), "slim holds at most 8")

    register_section(
        "mystack",
        (
            SectionKey("width", 4, "ranks per group", count=(1, False)),
            SectionKey("mode", "wide", "wide or slim", choices=("wide", "slim")),
            SectionKey("fused", False, "fuse the kernels", boolean=True),
            SectionKey("plan", [1, 2], "a list default is copied into each config"),
        ),
        check_mystack,
    )
    assert "mystack" in section_checks()
    config = RunnerConfig()
    config.steps = 1
    assert config.mystack.width == 4 and config.mystack.mode == "wide" and config.mystack.fused is False
    config.mystack.plan.append(3)
    assert RunnerConfig().mystack.plan == [1, 2]
    assert "ranks per group" in config.help_text()
    config.check()
    for key, value, fix in (
        ("mystack.width", 0, "use an integer >= 1"),
        ("mystack.mode", "thin", "use one of: wide, slim"),
        ("mystack.fused", "yes", "use true or false"),
    ):
        bad = RunnerConfig()
        bad.steps = 1
        bad.set(key, value)
        with pytest.raises(ConfigError, match=fix) as error:
            bad.check()
        assert error.value.key == key
    slim = RunnerConfig()
    slim.steps = 1
    with pytest.raises(ConfigError, match="slim holds at most 8"):
        slim.parse(["--mystack.width", "9", "--mystack.mode", "slim"], exit_on_error=False)


def test_a_new_stack_needs_no_shared_file(isolated_registry: None) -> None:
    register_stack("mystack", "perdure.runners.torch_runner:TorchRunner", aliases=("ms",))
    keys = (SectionKey("width", 4, "ranks per group"), SectionKey("layout.groups", 2, "how the ranks are grouped"))
    register_section("mystack", keys, stack="mystack", not_identity=("mystack.layout",))
    assert stack_names()[-2:] == ("mystack", "ms")
    assert stack_class("ms") is TorchRunner
    config = RunnerConfig()
    config.steps = 1
    config.stack = "ms"
    config.check()
    ids = {}
    for stack in ("torch", "mystack", "ms"):
        for width in (4, 8):
            config.stack, config.mystack.width = stack, width
            ids[stack, width] = config_id(config.to_plain())
    # its section is identity for itself (by its name or an alias), not for another stack
    assert ids["torch", 4] == ids["torch", 8]
    assert ids["mystack", 4] != ids["mystack", 8]
    assert ids["ms", 4] == ids["mystack", 4] and ids["ms", 8] == ids["mystack", 8]
    config.mystack.layout.groups = 3  # declared no part of the identity
    assert config_id(config.to_plain()) == ids["ms", 8]
    with pytest.raises(ValueError, match="outside the section"):
        register_section("other", keys, not_identity=("mystack.layout",))
