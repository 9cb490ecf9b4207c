"""A runner adds a metric logger through its `metric_loggers()` override point (an MLflow or Aim user writes a
`MetricLogger`, not a `log_metrics` override): it is opened after the restore, receives what the built-in loggers
receive, and is closed at the end; the built-in ones keep working beside it. A launched program's JSON-lines logger
(tests/scripts/jsonl_logger.py, the one docs/workspace.md shows) ends with exactly metrics.csv's rows, over a resume."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest

from perdure import MetricLogger, RunnerConfig, RunnerState
from perdure.loggers.metrics_csv import read_metrics_csv
from tests.runs import run, run_dir
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


def test_a_launched_program_with_its_own_json_lines_logger_gets_every_row_of_metrics_csv(tmp_path: Path) -> None:
    # tests/scripts/jsonl_logger.py: examples/mlp.py plus the logger docs/workspace.md shows. Run to step 20, then
    # extend to 30: the second launch resumes from step 20 and opens the logger with resumed_step=20.
    args = ("--log.interval", "5", "--ckpt.interval", "10")
    for steps, resumed in (("20", "starting fresh"), ("30", "resuming")):
        result = run("jsonl_logger.py", tmp_path, "--steps", steps, *args)
        assert result.returncode == 0, result.stdout + result.stderr
        assert resumed in result.stdout + result.stderr
    directory = run_dir(tmp_path)
    lines = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    rows = [(line["step"], line["split"], name, value) for line in lines for name, value in line["metrics"].items()]
    assert rows == read_metrics_csv(directory / "metrics.csv")  # the same rows, values and order, bit for bit
    assert [line["step"] for line in lines if line["split"] == "train"] == [5, 10, 15, 20, 25, 30]
    assert [line["step"] for line in lines if line["split"] == "val"] == [10, 20, 30]
    assert {"loss", "lr", "grad_norm"} <= set(lines[0]["metrics"])
