"""Which CheckpointManager a run saves with (`ckpt.backend`). Which one reads a checkpoint (its manifest's `backend`)
is the read path's choice (`read.checkpoint_format`)."""

from __future__ import annotations

import torch.distributed as dist

from perdure.checkpoints.base import CheckpointManager
from perdure.errors import ConfigError

BACKENDS = ("auto", "file", "dcp", "deepspeed")


def manager_class(backend: str, world_size: int) -> type[CheckpointManager]:
    """The manager class for `ckpt.backend`: `file`, `dcp`, `deepspeed` (the engine's own checkpoints, for
    stack=deepspeed, whose runner selects it itself), or `auto` (DCP when several ranks train, else file)."""
    if backend == "auto":
        backend = "dcp" if world_size > 1 and dist.is_available() else "file"
    if backend == "dcp" and not dist.is_available():
        raise ConfigError("ckpt.backend", backend, "this PyTorch build has no torch.distributed; use file or auto")
    return backend_class(backend)


def backend_class(backend: str) -> type[CheckpointManager]:
    """The manager class that writes checkpoints of `backend`."""
    if backend == "file":
        from perdure.checkpoints.file import FileCheckpointManager

        return FileCheckpointManager
    if backend == "dcp":
        from perdure.checkpoints.dcp import DCPCheckpointManager

        return DCPCheckpointManager
    if backend == "deepspeed":
        from perdure.checkpoints.deepspeed_engine import DeepSpeedCheckpointManager

        return DeepSpeedCheckpointManager
    raise ConfigError("ckpt.backend", backend, f"use one of {', '.join(BACKENDS)}")
