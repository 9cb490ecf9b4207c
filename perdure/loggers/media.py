"""Images logged by a run: PNG files under `media/` and an index of them in `media.jsonl`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from perdure.atomic import atomic_write
from perdure.loggers.base import MetricLogger
from perdure.loggers.files import MAX_LINES_BYTES, StepLines
from perdure.loggers.images import encode_png, to_image_array
from perdure.safe_io import (
    UnsafeFileError,
    ensure_dir,
    is_regular_or_missing,
    is_symlink,
    loads_json,
    read_regular,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

    from perdure.config import RunnerConfig
    from perdure.runners.state import RunnerState

MEDIA_DIR = "media"
INDEX_FILE = "media.jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_tag(tag: str) -> str:
    """`tag` as a directory name: every character outside [A-Za-z0-9._-] becomes `_` (`val/recon` -> `val_recon`)."""
    safe = _UNSAFE.sub("_", tag)
    return "_" if safe in ("", ".", "..") else safe


class MediaLogger(MetricLogger):
    """Writes each logged image to `media/<safe_tag>/<step:08d>_<index>.png` and appends one JSON line
    `{"step", "tag", "index", "path", "shape"}` to `media.jsonl` (`path` relative to the run dir).

    Metrics are ignored. A PNG is written before its index line (through a temporary file and a rename, so no torn
    PNG ever carries the final name); on a resume the lines after the restored step are dropped and their PNGs
    deleted, so the index holds each (step, tag, index) once. Needs no imaging library.
    """

    def __init__(self) -> None:
        self._run_dir: Path | None = None
        self._index: StepLines | None = None

    def open(self, run_dir: Path, *, resumed_step: int, state: RunnerState, config: RunnerConfig) -> None:
        self._run_dir = Path(run_dir)
        self._index = StepLines(self._run_dir / INDEX_FILE, step_of=lambda line: _record(line)["step"])
        for line in self._index.open(resumed_step):
            self._remove_dropped(line)

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        """Metrics are not media: nothing to do."""

    def log_image(self, tag: str, image: np.ndarray, step: int, index: int = 0) -> None:
        if self._run_dir is None or self._index is None:
            raise RuntimeError("MediaLogger.log_image before open()")
        array = to_image_array(image)
        relative = media_path(tag, step, index)
        path = self._run_dir / relative
        ensure_dir(self._run_dir / MEDIA_DIR)
        ensure_dir(path.parent)
        png = encode_png(array)
        atomic_write(path, lambda file: file.write(png), durable=False)  # a picture: not worth an fsync per image
        record = {"step": int(step), "tag": tag, "index": int(index), "path": relative.as_posix()}
        record["shape"] = list(array.shape)
        self._index.write(json.dumps(record))

    def flush(self, durable: bool = False) -> None:
        if self._index is not None:
            self._index.flush(durable)

    def sync(self) -> None:
        if self._index is not None:
            self._index.sync()

    def close(self) -> None:
        if self._index is not None:
            self._index.close()

    def _remove_dropped(self, line: str) -> None:
        """Delete the PNG of an index line a resume dropped (the resumed run writes it again if it logs it).

        media.jsonl may come from someone else, so a line only ever names a file this logger would have written for
        it: `path` must be exactly `media/<safe_tag(tag)>/<step>_<index>.png` of the line's own tag, step and index,
        and the file a regular one in real (not symlinked) directories under `media/`. Anything else is left alone."""
        try:
            record = _record(line)
            relative = media_path(record["tag"], record["step"], record["index"])
        except (ValueError, KeyError, TypeError):
            return
        if record.get("path") != relative.as_posix():
            return
        assert self._run_dir is not None  # `open` set it before reading the index
        directory = self._run_dir
        for part in relative.parts[:-1]:
            directory = directory / part
            if is_symlink(directory) or not directory.is_dir():
                return
        path = self._run_dir / relative
        try:
            if is_regular_or_missing(path):
                path.unlink()
        except (UnsafeFileError, FileNotFoundError):
            pass


def media_path(tag: str, step: int, index: int) -> Path:
    """Where `MediaLogger` writes image `index` of `tag` at `step`, relative to the run dir."""
    if not isinstance(tag, str) or any(isinstance(n, bool) or not isinstance(n, int) for n in (step, index)):
        raise TypeError("a media record needs a string tag and integer step / index")
    return Path(MEDIA_DIR) / safe_tag(tag) / f"{int(step):08d}_{int(index)}.png"


def _record(line: str) -> dict:
    """One media.jsonl line, parsed with a nesting bound (it may come from someone else)."""
    record = loads_json(line, max_depth=4)
    if not isinstance(record, dict):
        raise ValueError("a media record is a JSON object")
    return record


def read_media_index(run_dir: Path) -> list[dict]:
    """The records of a run's media.jsonl, in order (lines that are not records are skipped)."""
    path = Path(run_dir) / INDEX_FILE
    if not path.exists():
        return []
    records = []
    for line in read_regular(path, MAX_LINES_BYTES).decode("utf-8", errors="replace").splitlines():
        try:
            records.append(_record(line))
        except ValueError:
            continue
    return records
