"""The layers of docs/design.md hold: the leaf layer imports nothing else of perdure, the config imports only the leaf
layer and its own helpers (each stack, TorchFT and the mirror register their section's check instead), and a section
registered from outside the config runs in `RunnerConfig.check()`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from perdure import ConfigError, RunnerConfig
from perdure.config_checks import register_section_check, section_checks
from tests.test_import_cycles import ROOT, import_graph

LEAF = {"perdure.errors", "perdure.plain", "perdure.safe_io", "perdure.atomic", "perdure.private_api"}
CONFIG = {"perdure.config", "perdure.config_checks", "perdure.config_help", "perdure.config_text"}
BUILT_IN_SECTIONS = ["ckpt.interval", "ckpt.mirror", "deepspeed", "ft", "parallel"]


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def test_the_leaf_layer_and_the_config_import_nothing_above_them() -> None:
    graph = import_graph(ROOT / "perdure")
    for module in LEAF:
        assert reachable(graph, module) <= LEAF, module
    for module in CONFIG:
        assert reachable(graph, module) <= LEAF | CONFIG, module


def test_the_built_in_sections_are_registered_whatever_is_imported_first() -> None:
    # a fresh process that names only the config: the package's __init__ registers every built-in section
    program = textwrap.dedent(
        """
        from perdure.config import RunnerConfig
        from perdure.config_checks import section_checks
        print(list(section_checks()))
        config = RunnerConfig()
        config.steps = 1
        config.stack = "deepspeed"
        config.deepspeed.zero_stage = 5
        try:
            config.check()
        except Exception as error:
            print(type(error).__name__, error)
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    sections, error = result.stdout.splitlines()
    assert sections == repr(BUILT_IN_SECTIONS)
    assert error.startswith("ConfigError config key 'deepspeed.zero_stage' = 5")


def test_a_section_registered_outside_the_config_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    # what a new stack does in its own module: no shared file changes
    import perdure.config_checks

    monkeypatch.setattr(perdure.config_checks, "_SECTION_CHECKS", dict(perdure.config_checks._SECTION_CHECKS))

    def check_mystack(config: RunnerConfig, get) -> None:
        if get("stack") == "torch" and get("seed") == 7:
            raise ConfigError("seed", 7, "mystack's check: use another seed")

    register_section_check("mystack", check_mystack)
    assert list(section_checks()) == sorted([*BUILT_IN_SECTIONS, "mystack"])
    config = RunnerConfig()
    config.steps = 1
    config.check()
    config.seed = 7
    with pytest.raises(ConfigError, match="mystack's check"):
        config.check()
