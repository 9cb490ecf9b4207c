"""RunnerState: the replicated, plain-data part of a run that a checkpoint must carry."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from perdure.errors import CheckpointError
from perdure.runners.losses import losses_as_floats


@dataclass
class RunnerState:
    """Where training stands. Every field is plain data, identical on every rank.

    `samples_in_epoch` counts the samples of the current epoch all ranks together already consumed (a global offset),
    so that a resume continues from the very next sample, on any number of ranks. `results` keeps every evaluation
    ever run (keyed by the global step as a string, since the state is stored as JSON-compatible data) and, with
    `best_score` / `patience_count`, lets early stopping survive a resume.

    No field holds a tensor in a checkpoint: a tensor would come back on the CPU (or fail to load) while the run's own
    tensors live on its device. `state_dict()` turns one-element tensors into numbers (a metric a user's
    `reduce_metrics` returned as a tensor, say), and `load_state_dict()` does the same for checkpoints written before
    this rule (they carried `pending_losses` as the loop's tensors).
    """

    global_step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    attempt: int = 0
    skipped_steps: int = 0
    results: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    best_score: float | None = None
    best_step: int | None = None
    patience_count: int = 0
    early_stopped: bool = False
    wandb_run_id: str | None = None
    # A preemption signal stopped the evaluation due at this position: the next attempt runs it before training on.
    evaluation_pending: bool = False
    # Train losses of the steps since the last log line, as floats, so a resumed run logs the same averages.
    pending_losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        # New containers all the way down (what `_plain` builds), so a snapshot never shares them with the loop.
        state = {
            name: _plain(getattr(self, name), name) for name in self.__dataclass_fields__ if name != "pending_losses"
        }
        state["pending_losses"] = _as_floats(self.pending_losses, "pending_losses")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {name for name in self.__dataclass_fields__}
        for key, value in state.items():
            if key == "pending_losses":
                setattr(self, key, _as_floats(value, f"state.{key}"))
            elif key in known:
                setattr(self, key, _plain(value, f"state.{key}"))


def _as_floats(values: Any, where: str) -> list[float]:
    if not isinstance(values, (list, tuple)):
        raise CheckpointError(f"{where} is a {type(values).__name__}, not a list of losses")
    for index, value in enumerate(values):
        _check_number(value, f"{where}[{index}]")
    return losses_as_floats(values)


def _plain(value: Any, where: str) -> Any:
    """`value` with every one-element tensor inside it turned into a Python number."""
    if isinstance(value, torch.Tensor):
        _check_number(value, where)
        return value.item()
    if isinstance(value, dict):
        return {key: _plain(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def _check_number(value: Any, where: str) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_meta or value.is_complex():
            raise CheckpointError(
                f"{where} is a tensor of shape {tuple(value.shape)} on {value.device}, not a number: RunnerState "
                "holds plain data only (a loss or metric must be a one-element tensor with a value, or a float)"
            )
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointError(f"{where} is {value!r}, not a number: pending losses must be floats")
