"""RunnerState: the replicated, plain-data part of a run that a checkpoint must carry."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RunnerState:
    """Where training stands. Every field is plain data, identical on every rank.

    `samples_in_epoch` counts the samples of the current epoch all ranks together already consumed (a global offset),
    so that a resume continues from the very next sample, on any number of ranks. `results` keeps every evaluation
    ever run (keyed by the global step as a string, since the state is stored as JSON-compatible data) and, with
    `best_score` / `patience_count`, lets early stopping survive a resume.
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
    # Train losses of the steps since the last log line, so a resumed run logs the same averages.
    pending_losses: list = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {name for name in self.__dataclass_fields__}
        for key, value in state.items():
            if key in known:
                setattr(self, key, value)
