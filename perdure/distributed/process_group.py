"""Joining the process group: env:// under torchrun (or any launcher that sets RANK / WORLD_SIZE)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from perdure.errors import ConfigError


def launched_world_size() -> int:
    """WORLD_SIZE as the launcher set it (1 when the program was started on its own)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_local_world_size() -> int:
    """LOCAL_WORLD_SIZE as the launcher set it: the ranks on this host (1 when the program was started on its own)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def select_backend(requested: str) -> str:
    """`auto` is NCCL when CUDA is present, gloo otherwise; NCCL without CUDA is refused clearly."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend", requested, "NCCL needs CUDA devices; use auto or gloo on this machine")
    return requested


def init_process_group(backend: str = "auto", timeout_s: float = 600) -> tuple[int, int]:
    """Join (or reuse) the default process group; returns (rank, world_size). A lone process stays single."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if launched_world_size() == 1:
        return 0, 1
    chosen = select_backend(backend)
    if chosen == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(chosen, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def local_device() -> torch.device:
    """This rank's device: its CUDA device (LOCAL_RANK) when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
