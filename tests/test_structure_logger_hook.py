"""A runner adds a metric logger through its `metric_loggers()` override point (an MLflow or Aim user writes a
`MetricLogger`, not a `log_metrics` override): it is opened after the restore, receives what the built-in loggers
receive, and is closed at the end; the built-in ones keep working beside it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from perdure import MetricLogger, RunnerConfig, RunnerState
from tests.runs import run_dir
from tests.scripts.resumable import ResumableRunner, make_config

pytestmark = pytest.mark.timeout(120)


class RecordingLogger(MetricLogger):
    """Keeps what it is given, as a logger for another service would send it."""

    def __init__(self) -> None:
        self.events: list[tuple[str, ...]] = []
        self.metrics: list[tuple[str, dict[str, float], int]] = []

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        self.events.append(("open", run_dir.name, str(resumed_step)))

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        self.metrics.append((split, dict(metrics), step))

    def close(self) -> None:
        self.events.append(("close",))


class RunnerWithOwnLogger(ResumableRunner):
    def metric_loggers(self) -> list[MetricLogger]:
        self.recording = RecordingLogger()
        return [*super().metric_loggers(), self.recording]


def test_a_runner_adds_its_own_metric_logger_beside_the_built_in_ones(tmp_path: Path) -> None:
    config = make_config(tmp_path, steps=6, **{"log.interval": 3, "ckpt.interval": 6})
    runner = RunnerWithOwnLogger(config)
    names = [type(logger).__name__ for logger in runner.telemetry.loggers]
    assert names == ["MetricsCSV", "MediaLogger", "RecordingLogger"]
    runner.train()
    runner.close()
    recording = runner.recording
    assert recording.events == [("open", run_dir(tmp_path).name, "0"), ("close",)]
    train = [(step, metrics) for split, metrics, step in recording.metrics if split == "train"]
    assert [step for step, _ in train] == [3, 6]
    assert all("loss" in metrics and "lr" in metrics for _, metrics in train)
    # the built-in metrics.csv got the same train losses
    rows = [row.split(",") for row in (run_dir(tmp_path) / "metrics.csv").read_text().splitlines()[1:]]
    csv_losses = {int(step): float(value) for step, split, name, value in rows if (split, name) == ("train", "loss")}
    assert csv_losses == pytest.approx({step: metrics["loss"] for step, metrics in train})
