"""FileCheckpointManager: replicated state in `state.pth` (rank 0), rank-local state in `rank{r:05d}.pth`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.utils.serialization as serialization

from perdure.checkpoints.base import CheckpointManager, Stateful
from perdure.checkpoints.commit import FileRecord, write_file
from perdure.checkpoints.read import WeightsFormat, WeightsLocation, load_weights_file, register_format
from perdure.checkpoints.safe_unpickle import load_torch_file
from perdure.errors import CheckpointError

logger = logging.getLogger("perdure")

REPLICATED_FILE = "state.pth"


def _save(obj: Any, file: Any) -> None:
    """`torch.save` without the zip format's own CRC32: the manifest's checksum (computed while writing) already
    covers every byte, and the CRC costs torch.save most of its time. Files still load with plain `torch.load`."""
    config = serialization.config.save
    previous = config.compute_crc32
    config.compute_crc32 = False
    try:
        torch.save(obj, file)
    finally:
        config.compute_crc32 = previous


def local_file(rank: int) -> str:
    return f"rank{rank:05d}.pth"


class FileCheckpointManager(CheckpointManager):
    """Plain `torch.save` files, checksummed while they are written. Not collective."""

    backend = "file"
    collective = False

    def write(self, staging: Path, replicated: dict[str, Any], local: dict[str, Any]) -> dict[str, FileRecord]:
        files: dict[str, FileRecord] = {}
        if self.rank == 0:
            files[REPLICATED_FILE] = write_file(staging / REPLICATED_FILE, lambda f: _save(replicated, f))
        name = local_file(self.rank)
        files[name] = write_file(staging / name, lambda f: _save(local, f))
        return files

    def read(self, path: Path, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]) -> bool:
        replicated = load_torch_file(path / REPLICATED_FILE)
        for key, state in states.items():
            if key in replicated:
                state.load_state_dict(replicated[key])
        return read_local_states(path, self.rank, local_states)


def read_local_states(path: Path, rank: int, local_states: Mapping[str, Stateful]) -> bool:
    """Load `rank{rank:05d}.pth` of a checkpoint into the rank-local objects; False when the checkpoint has none for
    this rank (it was written by fewer ranks). Shared by every backend: rank-local state is always such a file."""
    local_path = path / local_file(rank)
    if not local_path.exists():
        return False
    local = load_torch_file(local_path)
    for key, state in local_states.items():
        if key in local:
            state.load_state_dict(local[key])
    return True


def read_file_weights(location: WeightsLocation, ema: bool = False, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The model (`ema`: EMA) weights of a file-backend checkpoint, from its `state.pth` (`mmap`: mapped, not read)."""
    path = location.info.path
    state = load_weights_file(path / REPLICATED_FILE, mmap=mmap)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"{path / REPLICATED_FILE} holds no model state; it is not a perdure checkpoint")
    if ema:
        if "ema" not in state:
            raise CheckpointError(f"checkpoint {path} holds no EMA weights (it was trained with ema.enabled=false)")
        weights = state["ema"].get("shadow") if isinstance(state["ema"], dict) else None
    else:
        weights = state["model"]
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        what = "EMA weights" if ema else "model weights"
        raise CheckpointError(f"{path / REPLICATED_FILE} holds no state dict of tensors as its {what}")
    return weights


register_format(WeightsFormat(FileCheckpointManager.backend, read=read_file_weights, manager=FileCheckpointManager))
