"""metrics.csv: every metric of a run, one row each (step, split, name, value), each step exactly once."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from perdure.loggers.base import MetricLogger
from perdure.loggers.files import MAX_LINES_BYTES, StepLines
from perdure.safe_io import read_regular

if TYPE_CHECKING:
    from perdure.config import RunnerConfig
    from perdure.runners.state import RunnerState

FILENAME = "metrics.csv"
HEADER = "step,split,name,value"


class MetricsCSV(MetricLogger):
    """Writes `<run dir>/metrics.csv` with the header `step,split,name,value` once.

    After a kill and a resume the file holds each step exactly once: `open` drops the rows an earlier attempt wrote
    after the restored checkpoint's step (the resumed run logs those steps again) and keeps every row up to it. Rows
    reach the OS at every `flush()` (a kill then loses nothing flushed; the runner flushes at log lines and before
    each checkpoint is written) and the disk at `flush(durable=True)`, which the runner calls once a checkpoint has
    committed.
    Values are written with `repr`, so they read back as the exact floats logged.
    """

    def __init__(self) -> None:
        self._lines: StepLines | None = None
        self._buffer = io.StringIO()
        self._writer = csv.writer(self._buffer, lineterminator="")

    @property
    def path(self) -> Path | None:
        """The file, once open."""
        return None if self._lines is None else self._lines.path

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        self._lines = StepLines(Path(run_dir) / FILENAME, step_of=_step_of, header=HEADER)
        self._lines.open(resumed_step)

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        if self._lines is None:
            raise RuntimeError("MetricsCSV.log_metrics before open()")
        for name, value in metrics.items():
            self._buffer.seek(0)
            self._buffer.truncate()
            self._writer.writerow((int(step), _one_line(split), _one_line(name), repr(float(value))))
            self._lines.write(self._buffer.getvalue())

    def flush(self, durable: bool = False) -> None:
        if self._lines is not None:
            self._lines.flush(durable)

    def sync(self) -> None:
        if self._lines is not None:
            self._lines.sync()

    def close(self) -> None:
        if self._lines is not None:
            self._lines.close()


def _one_line(text: str) -> str:
    return str(text).replace("\r", " ").replace("\n", " ")


def _step_of(line: str) -> int:
    return int(line.split(",", 1)[0])


def read_metrics_csv(path: Path) -> list[tuple[int, str, str, float]]:
    """The rows of a metrics.csv as `(step, split, name, value)` tuples, in file order."""
    text = read_regular(Path(path), MAX_LINES_BYTES, follow_symlinks=True).decode("utf-8")  # never a FIFO
    stream = io.StringIO(text, newline="")
    return [(int(row["step"]), row["split"], row["name"], float(row["value"])) for row in csv.DictReader(stream)]
