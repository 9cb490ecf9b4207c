"""Victim runs trained once per session; every test tampers with its own copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.security.hostile import copy_root, train_victim


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
