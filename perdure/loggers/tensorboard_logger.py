"""TensorBoard event files under `<run dir>/tensorboard/`, continued across resumes without a fold-back."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from perdure.loggers.base import MetricLogger, metric_tag
from perdure.loggers.console import get_logger
from perdure.loggers.images import encode_png, to_image_array
from perdure.safe_io import ensure_dir

if TYPE_CHECKING:
    from perdure.config import RunnerConfig
    from perdure.runners.state import RunnerState

TENSORBOARD_DIR = "tensorboard"
_EVENT_FILE = re.compile(r"^events\.out\.tfevents\.(\d+)\.")


class TensorBoardLogger(MetricLogger):
    """Scalars (`split/name`) and images for TensorBoard, through `torch.utils.tensorboard.SummaryWriter`.

    Each attempt appends a new event file to the same directory. A resumed attempt opens its writer with
    `purge_step = resumed_step + 1`: the writer's first events are a `SessionLog.START` at that step, on which
    TensorBoard discards every event of earlier files with a step >= it, i.e. what the dead attempt logged after the
    checkpoint, so the curves continue without a fold-back (TensorBoard's fast Rust loader also drops, per tag, the
    earlier points at or after a step that reappears). A fresh start over a directory that already has event files
    purges from step 0. Event files are read in name order, whose leading field is the creation time in whole
    seconds, so `open` waits (at most about a second) until the new file's name sorts after every existing one.

    Images are encoded to PNG here (no PIL needed) and written as TensorBoard image summaries.
    """

    def __init__(self, flush_secs: int = 30, max_queue: int = 100) -> None:
        self.flush_secs = flush_secs
        self.max_queue = max_queue
        self.writer: Any = None

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = ensure_dir(Path(run_dir) / TENSORBOARD_DIR)  # never a symlink to somewhere else
        existing = _event_file_seconds(log_dir)
        purge_step = None
        if existing:
            purge_step = resumed_step + 1 if resumed_step > 0 else 0
            _wait_past(max(existing))
        self.writer = SummaryWriter(
            str(log_dir), purge_step=purge_step, max_queue=self.max_queue, flush_secs=self.flush_secs
        )

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(metric_tag(split, name), float(value), global_step=int(step))

    def log_image(self, tag: str, image: np.ndarray, step: int, index: int = 0) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        from perdure.private_api import tensorboard_file_writer

        array = to_image_array(image)
        height, width, channels = array.shape
        picture = Summary.Image(height=height, width=width, colorspace=channels, encoded_image_string=encode_png(array))
        name = tag if index == 0 else f"{tag}_{index}"
        summary = Summary(value=[Summary.Value(tag=name, image=picture)])
        tensorboard_file_writer(self.writer).add_summary(summary, global_step=int(step))

    def flush(self, durable: bool = False) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _event_file_seconds(log_dir: Path) -> list[int]:
    """Creation seconds encoded in the names of the event files already in `log_dir`."""
    if not log_dir.is_dir():
        return []
    matches = (_EVENT_FILE.match(path.name) for path in log_dir.iterdir())
    return [int(match.group(1)) for match in matches if match]


def _wait_past(seconds: int, limit: float = 2.0) -> None:
    """Sleep until the wall clock's whole second exceeds `seconds`, so a new event file sorts after the old ones."""
    deadline = time.monotonic() + limit
    while int(time.time()) <= seconds:
        if time.monotonic() >= deadline:
            get_logger().warning(
                "tensorboard: an event file in this run is dated %d s in the future (clock skew?); "
                "TensorBoard may show this attempt's points before the earlier ones",
                seconds - int(time.time()),
            )
            return
        time.sleep(min(0.05, max(0.0, seconds + 1 - time.time())))
