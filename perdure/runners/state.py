"""RunnerState: the replicated, plain-data part of a run that a checkpoint must carry."""

from __future__ import annotations

import math
import re
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
    # `ckpt.interval auto` (perdure.runners.save_schedule): the step of the next interval save, decided at the save
    # this state is part of, and the mean stall of the run's saves it was decided from (over `save_stalls` saves).
    auto_save_step: int | None = None
    save_stall_s: float | None = None
    save_stalls: int = 0

    def state_dict(self) -> dict[str, Any]:
        # New containers all the way down (what `_plain` builds), so a snapshot never shares them with the loop.
        state = {
            name: _plain(getattr(self, name), name) for name in self.__dataclass_fields__ if name != "pending_losses"
        }
        state["pending_losses"] = _as_floats(self.pending_losses, "pending_losses")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state, refusing (CheckpointError, before anything changes) a field whose type or value
        this state never holds: the checkpoint may come from someone else. Unknown keys are ignored."""
        if not isinstance(state, dict):
            raise CheckpointError(f"the runner state is a {type(state).__name__}, not a mapping")
        loaded = {}
        for key, value in state.items():
            if key == "pending_losses":
                loaded[key] = _as_floats(value, f"state.{key}")
            elif key in self.__dataclass_fields__:
                loaded[key] = _plain(value, f"state.{key}")
                _check_field(key, loaded[key])
        for key, value in loaded.items():
            setattr(self, key, value)


COUNTS = ("global_step", "epoch", "samples_in_epoch", "attempt", "skipped_steps", "patience_count", "save_stalls")
FLAGS = ("early_stopped", "evaluation_pending")
WANDB_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def _check_field(name: str, value: Any) -> None:
    """Refuse a restored field whose type or value the state never holds."""
    where = f"state.{name}"
    if name in COUNTS or (name in ("best_step", "auto_save_step") and value is not None):
        if type(value) is not int or value < 0:
            raise CheckpointError(f"{where} is {value!r}, not a non-negative integer")
    elif name in FLAGS:
        if type(value) is not bool:
            raise CheckpointError(f"{where} is {value!r}, not true or false")
    elif name in ("best_score", "save_stall_s") and value is not None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise CheckpointError(f"{where} is {value!r}, not a number")
    elif name == "wandb_run_id" and value is not None:
        if not isinstance(value, str) or not WANDB_RUN_ID.fullmatch(value):
            raise CheckpointError(f"{where} is {value!r}, not a W&B run id (up to 128 letters, digits, '_' or '-')")
    elif name == "results":
        _check_results(value, where)


def _check_results(results: Any, where: str) -> None:
    """Evaluation results: {step (digits): {split: {metric: number}}}."""
    if not isinstance(results, dict):
        raise CheckpointError(f"{where} is a {type(results).__name__}, not a mapping of steps to results")
    for step, splits in results.items():
        if not isinstance(step, str) or not step.isdigit() or not isinstance(splits, dict):
            raise CheckpointError(f"{where} holds {step!r}: {type(splits).__name__}, not step: {{split: metrics}}")
        for split, metrics in splits.items():
            if not isinstance(split, str) or not isinstance(metrics, dict):
                raise CheckpointError(f"{where}[{step!r}] holds {split!r}, not split: {{metric: number}}")
            for metric, number in metrics.items():
                if not isinstance(metric, str) or not isinstance(number, (int, float)):
                    raise CheckpointError(f"{where}[{step!r}][{split!r}] holds {metric!r}: {number!r}, not a number")


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
