"""Images logged by a run: PNG files under `media/` and an index of them in `media.jsonl`."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from perdure.loggers.base import MetricLogger
from perdure.loggers.files import StepLines
from perdure.loggers.images import encode_png, to_image_array

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
        self._index = StepLines(self._run_dir / INDEX_FILE, step_of=lambda line: json.loads(line)["step"])
        for line in self._index.open(resumed_step):
            self._remove_dropped(line)

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        """Metrics are not media: nothing to do."""

    def log_image(self, tag: str, image: np.ndarray, step: int, index: int = 0) -> None:
        if self._run_dir is None or self._index is None:
            raise RuntimeError("MediaLogger.log_image before open()")
        array = to_image_array(image)
        relative = Path(MEDIA_DIR) / safe_tag(tag) / f"{int(step):08d}_{int(index)}.png"
        path = self._run_dir / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(encode_png(array))
        os.replace(temporary, path)
        record = {"step": int(step), "tag": tag, "index": int(index), "path": relative.as_posix()}
        record["shape"] = list(array.shape)
        self._index.write(json.dumps(record))

    def flush(self, durable: bool = False) -> None:
        if self._index is not None:
            self._index.flush(durable)

    def close(self) -> None:
        if self._index is not None:
            self._index.close()

    def _remove_dropped(self, line: str) -> None:
        """Delete the PNG of an index line a resume dropped (the resumed run writes it again if it logs it)."""
        try:
            relative = Path(json.loads(line)["path"])
        except (ValueError, KeyError, TypeError):
            return
        if relative.is_absolute() or ".." in relative.parts:
            return
        (self._run_dir / relative).unlink(missing_ok=True)


def read_media_index(run_dir: Path) -> list[dict]:
    """The records of a run's media.jsonl, in order."""
    path = Path(run_dir) / INDEX_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
