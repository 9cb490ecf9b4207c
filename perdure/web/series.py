"""What the charts and the media panels show: a run's `metrics.csv` as series, its `media.jsonl` as image records.

Both files are written by perdure's loggers (`loggers/metrics_csv.py`, `loggers/media.py`) but read here as untrusted:
bounded in size, malformed rows and lines skipped, non-finite values sent as null, media paths accepted only when they
are plain relative paths under `media/` (the server resolves them again before serving a byte).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path, PurePosixPath
from typing import Any, TypeGuard

import numpy as np

from perdure.web.files import MIB, read_text

METRICS_LIMIT = 256 * MIB
MEDIA_INDEX_LIMIT = 32 * MIB
MEDIA_LINE_LIMIT = 64 * 1024
MEDIA_DIR = "media"
IMAGE_SUFFIXES = {".png": "image/png"}
# The metric the loggers record each log interval, from which the time axis is rebuilt (metrics.csv has no clock).
RATE_METRIC = "train/steps_per_s"


def read_metrics(path: Path) -> dict[str, dict[str, list[Any]]]:
    """`{"split/name": {"step": [...], "value": [...]}}` from a metrics.csv, each series sorted by step.

    Rows that do not parse (a torn last line, garbage) are skipped; non-finite values become None.
    """
    text = read_text(path, METRICS_LIMIT)
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if header != ["step", "split", "name", "value"]:
        return {}
    series: dict[str, tuple[list[int], list[float | None]]] = {}
    for row in rows:
        if len(row) != 4:
            continue
        try:
            step, value = int(row[0]), float(row[3])
        except ValueError:
            continue
        steps, values = series.setdefault(f"{row[1]}/{row[2]}", ([], []))
        steps.append(step)
        values.append(value if math.isfinite(value) else None)
    result: dict[str, dict[str, list[Any]]] = {}
    for key, (steps, values) in series.items():
        order = sorted(range(len(steps)), key=steps.__getitem__)
        result[key] = {"step": [steps[i] for i in order], "value": [values[i] for i in order]}
    return result


def add_train_time(series: dict[str, dict[str, list[Any]]]) -> str | None:
    """Give every series a `time` list: seconds of training at each step, rebuilt from `train/steps_per_s`.

    Each logged rate covers the steps since the previous row, so the time at a logged step is the sum of
    (steps in the interval / rate); steps in between are interpolated. This is training time: evaluation, checkpoint
    and downtime between attempts are not in it. Returns the metric used, or None (then no series gets `time`).
    """
    rate = series.get(RATE_METRIC)
    if not rate or not rate["step"]:
        return None
    marks, seconds, previous, elapsed = [0], [0.0], 0, 0.0
    for step, value in zip(rate["step"], rate["value"]):
        if value and value > 0 and step > previous:
            elapsed += (step - previous) / value
            marks.append(step)
            seconds.append(elapsed)
            previous = step
    if len(marks) < 2:
        return None
    for entry in series.values():
        times = np.interp(np.asarray(entry["step"], dtype=np.float64), marks, seconds)
        entry["time"] = [round(float(t), 6) for t in times]
    return RATE_METRIC


def downsample(entry: dict[str, list[Any]], max_points: int) -> dict[str, list[Any]]:
    """At most `max_points` evenly strided points of a series (the last point always kept)."""
    count = len(entry["step"])
    if count <= max_points or max_points < 2:
        return entry
    picks = sorted({round(i * (count - 1) / (max_points - 1)) for i in range(max_points)})
    return {key: [values[i] for i in picks] for key, values in entry.items()}


def read_media(path: Path) -> list[dict[str, Any]]:
    """The image records of a media.jsonl: `{"tag", "step", "index", "path"}`, sorted by tag, step and index.

    A line that is not a JSON object with a str `tag`, int `step` and `index` and a plain relative `path` under
    `media/` with an image suffix is skipped; a (tag, step, index) seen twice keeps its last line.
    """
    records: dict[tuple[str, int, int], dict[str, Any]] = {}
    for line in read_text(path, MEDIA_INDEX_LIMIT).splitlines():
        if not line or len(line) > MEDIA_LINE_LIMIT:
            continue
        try:
            data = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(data, dict):
            continue
        tag, step, index, where = data.get("tag"), data.get("step"), data.get("index", 0), data.get("path")
        if not (isinstance(tag, str) and _is_int(step) and _is_int(index) and _media_path(where)):
            continue
        records[(tag, step, index)] = {"tag": tag, "step": step, "index": index, "path": where}
    return [records[key] for key in sorted(records)]


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _media_path(value: Any) -> TypeGuard[str]:
    if not isinstance(value, str) or "\\" in value or "\0" in value:
        return False
    pure = PurePosixPath(value)
    return (
        not pure.is_absolute()
        and ".." not in pure.parts
        and len(pure.parts) >= 2
        and pure.parts[0] == MEDIA_DIR
        and pure.suffix.lower() in IMAGE_SUFFIXES
    )
