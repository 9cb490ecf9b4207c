"""RunnerFields: the runner's shared fields and the override points its parts call, declared once and typed.

`BaseRunner` owns components (`runner.attempt`: runners/attempt.py; `runner.evaluator`: runners/evaluation.py;
`runner.checkpointing`: runners/checkpoint_binding.py), inherits their override points (`AttemptHooks`,
`EvaluationHooks`, `CheckpointHooks`: checkpointing.py), and is put together from parts, one concept per file
(metrics.py, data_setup.py, accumulation.py); a stack (torch_runner.py, parallel_runner.py, deepspeed_runner.py) and
the TorchFT layer (`perdure.ft.runner.FaultTolerant`) sit in front of it. Each piece
reads fields that `BaseRunner.__init__` (or another piece) sets, and calls methods that BaseRunner, another part or a
stack defines.
Every part and the TorchFT layer inherit this class, so those fields and methods are declared in one place, and a
type checker checks that the pieces fit.

At run time the class holds no value: the fields are annotations only, and each method here raises
NotImplementedError and is defined again by BaseRunner, one of its parts or a stack, which all come before this class
in a runner's MRO (it is the root of every runner class, just above `object`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import logging
    from collections.abc import Callable, Mapping
    from contextlib import AbstractContextManager
    from pathlib import Path

    import torch
    from torch import nn

    from perdure.checkpoints.base import CheckpointManager, Stateful
    from perdure.checkpoints.hf_adapter import StateDictAdapter
    from perdure.checkpoints.resolve import CheckpointInfo
    from perdure.checkpoints.source import RestoreSource
    from perdure.config import RunnerConfig
    from perdure.data.loader import ResumableLoader
    from perdure.resilience.hang_watch import HangWatch
    from perdure.resilience.signals import PreemptionHandler
    from perdure.runners.cadence import Cadence
    from perdure.runners.divergence import SkippedSteps
    from perdure.runners.ema import ExponentialMovingAverage
    from perdure.runners.save_schedule import SaveSchedule
    from perdure.runners.state import RunnerState
    from perdure.runners.stragglers import StragglerWatch
    from perdure.runners.telemetry import RunTelemetry
    from perdure.runners.throughput import ThroughputMeter
    from perdure.workspace.run_dir import RunDir


class RunnerFields:
    """The fields every part of a runner may read, and the methods one part calls that another piece defines."""

    # ---- set by `BaseRunner.__init__` (the user's `__init__` assigns model, criterion, optimizer, datasets) ------
    config: RunnerConfig
    logger: logging.Logger
    state: RunnerState
    rank: int
    world_size: int
    device: torch.device  # set by the stack when it starts (the device this process trains on)
    # None until the user's `__init__` assigns it (`__post_init__` refuses a runner without one): a Module after that
    model: nn.Module
    criterion: Callable[..., torch.Tensor] | None  # what the default train_step / evaluate_step call
    # None until `__post_init__` builds the default one (unless the user's `__init__` assigned one)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    ema: ExponentialMovingAverage | None
    datasets: dict[str, Any]
    collate_fns: dict[str, Callable[[list[Any]], Any]]  # per split: how samples become a batch
    checkpointed: dict[str, Stateful]  # the user's own objects, saved after the runner's
    dataloaders: dict[str, ResumableLoader]
    is_best: bool  # the last evaluation improved the score
    save_failures: list[str]
    preemption: PreemptionHandler
    stop_signal: int  # the signal all ranks agreed to stop for (0: none)
    inspection: bool  # built by `from_checkpoint`: a setup failure then records nothing
    hang_watch: HangWatch
    telemetry: RunTelemetry
    meter: ThroughputMeter  # the speed, memory and ETA columns of train log lines
    stragglers: StragglerWatch  # each rank's step time, at log lines

    # ---- the run `runner.attempt` decided (runners/attempt.py) ----------------------------------------------------
    run_dir: RunDir
    restore_source: RestoreSource
    checkpoints: CheckpointManager
    # what a restore on another topology changed (`note_topology`), kept in the attempt's record; None: nothing
    topology_change: dict[str, Any] | None

    # ---- the training loop (runners/base.py) -------------------------------------------------------------------
    cadence: Cadence  # set when training starts
    save_schedule: SaveSchedule  # set when training starts
    _losses: list[torch.Tensor | float]  # since the last log line: floats carried over a resume, then tensors
    _skips: SkippedSteps

    if TYPE_CHECKING:
        # `BaseRunner.__init__` sets the fields above; the TorchFT layer calls it through `super().__init__(config)`.
        def __init__(self, config: RunnerConfig) -> None: ...

    # ---- override points of BaseRunner and the stacks ----------------------------------------------------------

    @property
    def is_main_process(self) -> bool:
        raise NotImplementedError

    def random_stream(self) -> int:
        raise NotImplementedError

    def data_shard(self) -> tuple[int, int]:
        raise NotImplementedError

    def data_parallel_rank(self) -> tuple[int, int]:
        raise NotImplementedError

    def unwrap_model(self) -> nn.Module:
        raise NotImplementedError

    def autocast(self) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager[Any]:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def extra_states(self) -> dict[str, Stateful]:
        raise NotImplementedError

    def begin_step(self) -> bool:
        raise NotImplementedError

    def commit_step(self) -> bool:
        raise NotImplementedError

    def stop_requested(self) -> bool:
        raise NotImplementedError

    def train_step(self, batch: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def evaluate_step(self, batch: Any) -> Mapping[str, torch.Tensor | float]:
        raise NotImplementedError

    def infer_step(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def batch_tokens(self, batch: Any) -> int:
        raise NotImplementedError

    def flops_per_token(self) -> float | None:
        raise NotImplementedError

    def close(self, status: str = "stopped", reason: str = "closed") -> None:
        raise NotImplementedError

    def _checkpoint_manager(self, token: str = "") -> CheckpointManager:
        raise NotImplementedError

    def _stop_for_preemption(self) -> None:
        raise NotImplementedError

    # ---- what one part calls of another -------------------------------------------------------------------------

    # runners/checkpointing.py
    def checkpoint_states(self) -> dict[str, Stateful]:
        raise NotImplementedError

    def checkpoint_local_states(self) -> dict[str, Stateful]:
        raise NotImplementedError

    def save_checkpoint(self, reason: str) -> Path | None:
        raise NotImplementedError

    def restore(self, source: RestoreSource) -> None:
        raise NotImplementedError

    def read_pretrained(self, path: Path) -> Any:
        raise NotImplementedError

    def export_model(self) -> Path | None:
        raise NotImplementedError

    def export_hf(self, target: str | Path | None = None) -> Path | None:
        raise NotImplementedError

    def state_dict_adapter(self) -> StateDictAdapter | None:
        raise NotImplementedError

    def hf_config(self) -> Any:
        raise NotImplementedError

    def write_hf_weights(self, staging: Path, ema: bool) -> None:
        raise NotImplementedError

    def note_topology(self, info: CheckpointInfo) -> dict[str, Any] | None:
        raise NotImplementedError

    # runners/data_setup.py
    def build_dataloaders(self) -> None:
        raise NotImplementedError

    def total_steps_hint(self) -> int:
        raise NotImplementedError

    # runners/metrics.py
    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        raise NotImplementedError
