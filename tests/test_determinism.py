"""The `deterministic` key (issue 9): off by default and then touching nothing; on, it selects deterministic
algorithms, deterministic cuDNN and a fixed cuBLAS workspace before anything can initialise CUDA, on any device."""

from __future__ import annotations

import os

import pytest
import torch

from perdure import ConfigError
from tests.scripts.resumable import ResumableRunner, make_config


@pytest.fixture
def global_flags(monkeypatch):
    """Leave the process's determinism settings as the test found them."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "placeholder")  # recorded: undone after the test
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    cudnn = torch.backends.cudnn
    before = (torch.are_deterministic_algorithms_enabled(), cudnn.deterministic, cudnn.benchmark)
    yield
    torch.use_deterministic_algorithms(before[0])
    cudnn.deterministic, cudnn.benchmark = before[1], before[2]


def test_deterministic_runs_train_on_the_cpu_with_every_switch_set(tmp_path, global_flags):
    runner = ResumableRunner(make_config(tmp_path, steps=6, deterministic=True))
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    runner.train()
    assert runner.global_step == 6


def test_off_by_default_it_changes_nothing_and_a_users_workspace_setting_is_kept(tmp_path, global_flags, monkeypatch):
    ResumableRunner(make_config(tmp_path / "a", steps=2)).close()
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    ResumableRunner(make_config(tmp_path / "b", steps=2, deterministic=True)).close()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and torch.are_deterministic_algorithms_enabled()


def test_deterministic_is_a_bool_and_not_part_of_the_run_identity(tmp_path):
    with pytest.raises(ConfigError, match="deterministic"):
        make_config(tmp_path, steps=2, deterministic="yes").check()
    from perdure.workspace.identity import config_id

    assert config_id(make_config(tmp_path, steps=2)) == config_id(make_config(tmp_path, steps=2, deterministic=True))
