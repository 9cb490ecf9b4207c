"""perdure: a PyTorch trainer whose runs survive anything and resume bit for bit."""

from typing import TYPE_CHECKING

from perdure import sections as sections  # importing it registers the built-in config sections' checks
from perdure.checkpoints import formats as formats  # importing it registers every format the read path reads
from perdure.checkpoints.base import CheckpointManager, CheckpointPolicy
from perdure.checkpoints.file import FileCheckpointManager
from perdure.checkpoints.hf_adapter import StateDictAdapter
from perdure.config import RunnerConfig
from perdure.data.iterable import NodeDataset
from perdure.data.loader import ResumableLoader
from perdure.data.sample_folder import SampleFolder, write_sample_folder
from perdure.data.sampler import ResumableSampler
from perdure.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointStateError,
    CodeIdentityError,
    ConfigError,
    PerdureError,
    ResumeError,
    RunStuckError,
    StackNotAvailableError,
    UnsafeFileError,
    WeightsMisfitError,
    WorkspaceError,
)
from perdure.ft.runner import FaultTolerant
from perdure.loggers.base import MetricLogger
from perdure.runners.base import BaseRunner
from perdure.runners.compile import plain_state_dict, strip_compile_prefix
from perdure.runners.deepspeed_runner import DeepSpeedRunner
from perdure.runners.runner import Runner
from perdure.runners.state import RunnerState
from perdure.runners.torch_runner import TorchRunner

__version__ = "0.1.0"

if TYPE_CHECKING:  # a type checker sees the class; at run time it is imported on first use (below)
    from perdure.runners.parallel_runner import ParallelRunner


def __getattr__(name: str) -> type:
    """`perdure.ParallelRunner`, imported on first use (FSDP and DTensor imports cost half a second a process)."""
    if name == "ParallelRunner":
        from perdure.runners.parallel_runner import ParallelRunner

        return ParallelRunner
    raise AttributeError(f"module 'perdure' has no attribute {name!r}")


__all__ = [
    "BaseRunner",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointPolicy",
    "CheckpointStateError",
    "CodeIdentityError",
    "ConfigError",
    "DeepSpeedRunner",
    "FaultTolerant",
    "FileCheckpointManager",
    "MetricLogger",
    "NodeDataset",
    "ParallelRunner",
    "PerdureError",
    "ResumableLoader",
    "ResumableSampler",
    "ResumeError",
    "RunStuckError",
    "Runner",
    "RunnerConfig",
    "RunnerState",
    "SampleFolder",
    "StackNotAvailableError",
    "StateDictAdapter",
    "TorchRunner",
    "UnsafeFileError",
    "WeightsMisfitError",
    "WorkspaceError",
    "plain_state_dict",
    "strip_compile_prefix",
    "write_sample_folder",
]
