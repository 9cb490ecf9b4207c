"""examples/mlp.py plus a metric logger of its own, added through the runner's `metric_loggers()` override point: every
`log_metrics` call as one JSON line in `<run dir>/metrics.jsonl` (an MLflow or Aim logger calls its client the same
way, in `log_metrics`). docs/workspace.md shows this program; tests/test_structure_logger_hook.py launches it."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from examples.mlp import Config, MLPRunner
from perdure import MetricLogger, RunnerConfig, RunnerState


class JSONLinesLogger(MetricLogger):
    """`{"step": ..., "split": ..., "metrics": {name: value}}` per call, in `metrics.jsonl`."""

    def __init__(self) -> None:
        self.file: TextIO | None = None

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        path = run_dir / "metrics.jsonl"
        # A resumed run logs again the steps after its checkpoint: keep an earlier attempt's lines up to it only
        # (and no line a kill cut short).
        kept = []
        if path.exists():
            lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            kept = [line for line in lines if line.endswith("\n") and json.loads(line)["step"] <= resumed_step]
        self.file = path.open("w", encoding="utf-8")
        self.file.writelines(kept)

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        assert self.file is not None, "the runner calls open() before any log_metrics()"
        self.file.write(json.dumps({"step": step, "split": split, "metrics": dict(metrics)}) + "\n")

    def flush(self, durable: bool = False) -> None:
        if self.file is not None:
            self.file.flush()
            if durable:
                os.fsync(self.file.fileno())

    def sync(self) -> None:
        file = self.file  # on the runner's durability thread: file descriptors only
        if file is not None:
            os.fsync(file.fileno())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class MyRunner(MLPRunner):
    def metric_loggers(self) -> list[MetricLogger]:
        return [*super().metric_loggers(), JSONLinesLogger()]


if __name__ == "__main__":
    MyRunner(Config().parse()).train()
