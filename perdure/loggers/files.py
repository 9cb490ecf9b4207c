"""Append-only line files (metrics.csv, media.jsonl) that a resumed run cuts back to its checkpoint's step."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from perdure.atomic import TEMPORARY_MARK, atomic_write_text
from perdure.safe_io import (
    UnsafeFileError,
    ensure_dir,
    is_regular_or_missing,
    move_aside,
    open_writable,
    read_regular,
)

logger = logging.getLogger("perdure")
MAX_LINES_BYTES = 1 << 30  # metrics.csv of a very long run; beyond this the file is not one perdure wrote


class StepLines:
    """A text file holding one record per line, each record logged at a training step.

    `open(resumed_step)` first cuts the file back to what the restored checkpoint vouches for: records with a step
    after `resumed_step` were written by an attempt that died after its last checkpoint, and the resumed run logs
    those steps again, so they are dropped (with `resumed_step == 0`, a fresh start, every record is). A torn last
    line (the process died mid-write) and lines `step_of` cannot read are dropped too. The cut is an atomic
    rewrite: temporary file, fsync, `os.replace`, fsync of the directory; a file that needs no cut is not touched.
    """

    def __init__(self, path: Path, step_of: Callable[[str], int], header: str | None = None) -> None:
        self.path = Path(path)
        self.header = header
        self._step_of = step_of
        self._file: IO[str] | None = None

    def open(self, resumed_step: int) -> list[str]:
        """Cut the file back to `resumed_step`, open it for appending; return the dropped records.

        The file is never written through a symlink: a symlink (or a FIFO, a device) in its place is moved aside with
        a warning, its target untouched, and the file starts anew."""
        ensure_dir(self.path.parent)
        stale_names = (f".{self.path.name}{TEMPORARY_MARK}*", f".{self.path.name}.*.tmp")  # the second: older perdure
        for stale in (path for name in stale_names for path in self.path.parent.glob(name)):  # an interrupted rewrite
            stale.unlink(missing_ok=True)  # a symlink is removed itself, never its target
        try:
            is_regular_or_missing(self.path)
        except UnsafeFileError as error:
            aside = move_aside(self.path, "unexpected")
            logger.warning("%s; moved it to %s (its target is untouched) and started a new one", error, aside.name)
        dropped = self._cut(resumed_step)
        self._file = os.fdopen(open_writable(self.path, append=True), "a", encoding="utf-8", newline="")
        if self.header is not None and self._file.tell() == 0:
            self._file.write(self.header + "\n")
        return dropped

    def write(self, line: str) -> None:
        """Append one record (no newline in `line`)."""
        if self._file is None:
            raise RuntimeError(f"{self.path.name} is not open: call open() first")
        self._file.write(line + "\n")

    def flush(self, durable: bool = False) -> None:
        """Hand buffered records to the OS (enough to survive a kill); `durable` also fsyncs (survives power loss)."""
        if self._file is None:
            return
        self._file.flush()
        if durable:
            os.fsync(self._file.fileno())

    def sync(self) -> None:
        """fsync what `flush` handed to the OS, from any thread: only the file descriptor is touched (a file closed
        meanwhile is skipped; it was made durable by its close)."""
        file = self._file
        if file is None:
            return
        try:
            descriptor = file.fileno()
        except ValueError:
            return
        os.fsync(descriptor)

    def close(self) -> None:
        """Flush durably and close; idempotent."""
        if self._file is None:
            return
        self.flush(durable=True)
        self._file.close()
        self._file = None

    def _cut(self, resumed_step: int) -> list[str]:
        if not self.path.exists():
            return []
        data = read_regular(self.path, MAX_LINES_BYTES)
        lines = data.decode("utf-8", errors="replace").split("\n")
        torn = lines.pop()  # text after the last newline: empty, or a record cut short by a kill
        changed = bool(torn)
        kept: list[str] = []
        dropped: list[str] = []
        if self.header is not None:
            if lines and lines[0] == self.header:
                kept.append(lines.pop(0))
            else:
                kept.append(self.header)
                changed = True
        for line in lines:
            step = self._step_or_none(line)
            keep = resumed_step > 0 and step is not None and step <= resumed_step
            (kept if keep else dropped).append(line)
        if changed or dropped:
            atomic_write_text(self.path, "".join(line + "\n" for line in kept))
        return dropped

    def _step_or_none(self, line: str) -> int | None:
        try:
            return int(self._step_of(line))
        except (ValueError, TypeError, KeyError, IndexError):
            return None
