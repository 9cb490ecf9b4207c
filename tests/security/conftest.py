"""Victim runs trained once per session; every test tampers with its own copy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.runs import SCRIPTS
from tests.security.hostile import copy_root, train_victim


@pytest.fixture(autouse=True)
def as_training_script(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs name their run directory from the code of the training script, as its subprocess runs do."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / "resumable.py")])


@pytest.fixture(scope="session")
def file_victim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("file-victim") / "runs"
    train_victim(root)
    return root


@pytest.fixture(scope="session")
def dcp_victim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp-victim") / "runs"
    train_victim(root, **{"ckpt.backend": "dcp"})
    return root


@pytest.fixture
def file_root(file_victim: Path, tmp_path: Path) -> Path:
    """A private copy of a finished file-backend run (checkpoints at steps 2 and 4)."""
    return copy_root(file_victim, tmp_path / "runs")


@pytest.fixture
def dcp_root(dcp_victim: Path, tmp_path: Path) -> Path:
    """A private copy of a finished DCP run (checkpoints at steps 2 and 4)."""
    return copy_root(dcp_victim, tmp_path / "runs")
