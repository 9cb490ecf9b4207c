"""The metric logger contract and the group the runner holds (the loggers a config asks for: `factory.py`)."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from perdure.loggers.images import to_image_array

if TYPE_CHECKING:
    from perdure.config import RunnerConfig
    from perdure.runners.state import RunnerState

_log = logging.getLogger("perdure")

__all__ = ["LoggerGroup", "MetricLogger", "metric_tag", "to_image_array"]


def metric_tag(split: str, name: str) -> str:
    """The name a metric gets in TensorBoard and W&B: `split/name`."""
    return f"{split}/{name}"


class MetricLogger(ABC):
    """A destination for metrics.

    The runner, on the main process only: `open()` once after the restore, `log_metrics()` / `log_image()` as events
    happen, `flush()` at every log interval and before each checkpoint is written, `flush(durable=True)` once it has
    committed, `close()` at the end. `open` receives the step of the restored checkpoint (0 for a fresh start): a
    logger that keeps files drops what an earlier attempt logged after that step, since the resumed run logs those
    steps again.
    """

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        """Prepare to log into `run_dir`. Called once, after the restore, before the first `log_*`."""
        return None

    @abstractmethod
    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        """Record `metrics` of `split` (train, val, ...) at global step `step`."""

    def log_image(self, tag: str, image: np.ndarray, step: int, index: int = 0) -> None:
        """Record an HWC uint8 image (see `to_image_array`) under `tag` at `step`. Default: ignored."""
        return None

    def flush(self, durable: bool = False) -> None:
        """Push what was logged to disk: enough to survive a kill; `durable` must also survive a power loss."""
        return None

    def sync(self) -> None:
        """Make what an earlier `flush()` handed to the OS survive a power loss. Called from a thread other than the
        one that logs (an fsync can take seconds on a busy filesystem): it may touch file descriptors only."""
        return None

    def close(self) -> None:
        """Flush and release everything. Idempotent."""
        return None


class LoggerGroup:
    """The loggers of one run, fanned out to as one. Converts each image once for all of them."""

    def __init__(self, loggers: Iterable[MetricLogger]) -> None:
        self.loggers = list(loggers)
        self._failing: set[MetricLogger] = set()

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        for logger in self.loggers:
            logger.open(Path(run_dir), resumed_step=resumed_step, state=state, config=config)

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        values = {name: float(value) for name, value in metrics.items()}
        for logger in self.loggers:
            self._guarded(logger, logger.log_metrics, split, values, step)

    def log_image(self, tag: str, image: Any, step: int, index: int = 0) -> None:
        array = to_image_array(image)
        for logger in self.loggers:
            self._guarded(logger, logger.log_image, tag, array, step, index)

    def flush(self, durable: bool = False) -> None:
        for logger in self.loggers:
            self._guarded(logger, logger.flush, durable)

    def sync(self) -> None:
        for logger in self.loggers:
            self._guarded(logger, logger.sync)

    def _guarded(self, logger: MetricLogger, call: Any, *args: Any) -> None:
        """Run one logger's call; an I/O failure (a full disk) is warned about once per logger and training goes on:
        metrics are worth less than the run that produces them."""
        try:
            call(*args)
        except OSError as error:
            if logger not in self._failing:
                _log.warning("%s could not write (%s); training goes on", type(logger).__name__, error)
            self._failing.add(logger)

    def close(self) -> None:
        """Close every logger, even when one fails; an I/O failure is warned about as in `flush`, the first other
        failure is raised afterwards."""
        failure: BaseException | None = None
        for logger in self.loggers:
            try:
                self._guarded(logger, logger.close)
            except Exception as error:  # noqa: BLE001 - the others must still close
                failure = failure or error
        if failure is not None:
            raise failure

    def __iter__(self):
        return iter(self.loggers)

    def __len__(self) -> int:
        return len(self.loggers)
