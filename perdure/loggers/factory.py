"""The loggers a config asks for. It imports every logger class, so it sits above them and `base.py` (their
contract) imports none of them. A runner adds its own through `metric_loggers()` (runners/metrics.py)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from perdure.errors import ConfigError
from perdure.loggers.base import MetricLogger
from perdure.loggers.media import MediaLogger
from perdure.loggers.metrics_csv import MetricsCSV

if TYPE_CHECKING:
    from perdure.config import RunnerConfig


def build_loggers(config: RunnerConfig) -> list[MetricLogger]:
    """The loggers `config` asks for: metrics.csv and the media writer always, TensorBoard if
    `tensorboard.enabled`, W&B if `wandb.enabled` (and `wandb.mode` is not `disabled`; `wandb.rewind`, when the
    config has that key, turns on W&B's run rewind).

    Raises `ConfigError` when an enabled backend is not installed, before anything is written.
    """
    loggers: list[MetricLogger] = [MetricsCSV(), MediaLogger()]
    if config.lookup("tensorboard.enabled", False):
        _require("tensorboard", "tensorboard.enabled", "pip install tensorboard")
        from perdure.loggers.tensorboard_logger import TensorBoardLogger

        loggers.append(TensorBoardLogger())
    if config.lookup("wandb.enabled", False) and config.lookup("wandb.mode", "online") != "disabled":
        _require("wandb", "wandb.enabled", "pip install wandb")
        from perdure.loggers.wandb_logger import WandbLogger

        loggers.append(WandbLogger(rewind=bool(config.lookup("wandb.rewind", False))))
    return loggers


def _require(module: str, key: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(key, True, f"the '{module}' package is not installed; {install}, or set --{key} false")
