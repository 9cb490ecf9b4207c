"""The one read path (`perdure.checkpoints.read`): every built-in format is registered once perdure is imported, a
format plugs in by registering itself (its weights read by `read_weights`, its checkpoints restored by its manager
whichever backend the run saves with), and a checkpoint of a backend no registered format reads is refused by name."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from perdure.checkpoints import read
from perdure.checkpoints.base import CheckpointPolicy
from perdure.checkpoints.file import FileCheckpointManager
from perdure.checkpoints.read import WeightsFormat, WeightsLocation, read_weights, register_format
from perdure.checkpoints.resolve import resolve_path
from perdure.errors import CheckpointError


class Counter:
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class ToyManager(FileCheckpointManager):
    """A backend of its own name that writes as the file backend does; its reads are recorded."""

    backend = "toy"
    reads: list[Path] = []

    def read(self, path: Path, states: Mapping[str, Any], local_states: Mapping[str, Any]) -> bool:
        ToyManager.reads.append(path)
        return super().read(path, states, local_states)


def _toy_weights(location: WeightsLocation, ema: bool, mmap: bool) -> dict[str, torch.Tensor]:
    return {"_orig_mod.toy": torch.full((2,), float(location.info.manifest["global_step"]))}


@pytest.fixture
def toy_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(read, "_FORMATS", dict(read._FORMATS))  # the registration ends with the test
    monkeypatch.setattr(ToyManager, "reads", [])
    register_format(WeightsFormat("toy", read=_toy_weights, manager=ToyManager))


def _save(manager: FileCheckpointManager, step: int) -> Path:
    saved = manager.save(f"ckpt-s{step:012d}", {"counter": Counter(step)}, {}, meta={"global_step": step})
    assert saved is not None
    return saved


def test_every_built_in_format_is_registered() -> None:
    assert {"pt", "safetensors", "file", "dcp", "deepspeed"} <= set(read._FORMATS)
    assert read.checkpoint_format("pt") is None  # a weight-file format restores no training state
    assert read.checkpoint_format("dcp") is not None and read.checkpoint_format(["dcp"]) is None


def test_a_registered_format_is_read_and_restored_through_the_one_entry(toy_format: None, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    saved = _save(ToyManager(root, CheckpointPolicy()), 7)
    assert read_weights(saved)["toy"].tolist() == [7.0, 7.0]  # the format's reader, compile prefix removed
    # A run that saves with the file backend restores the toy checkpoint through the toy format's manager.
    counter = Counter()
    assert FileCheckpointManager(root, CheckpointPolicy()).load(resolve_path(saved), {"counter": counter}, {}) is True
    assert counter.step == 7 and ToyManager.reads == [saved]


def test_a_checkpoint_no_registered_format_reads_is_refused(toy_format: None, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    saved = _save(ToyManager(root, CheckpointPolicy()), 3)
    del read._FORMATS["toy"]
    with pytest.raises(CheckpointError, match="written by backend 'toy', which this version of perdure cannot read"):
        FileCheckpointManager(root, CheckpointPolicy()).load(resolve_path(saved), {"counter": Counter()}, {})
