"""The `perdure` logger: plain lines on the console, the same lines in the run's log file."""

from __future__ import annotations

import logging
import os
import sys
import weakref
from pathlib import Path

from perdure.loggers.progress import ProgressBar
from perdure.safe_io import ensure_dir, escape_terminal, open_writable

LOGGER_NAME = "perdure"
_FORMAT = "%(asctime)s %(levelname)s %(message)s"


_progress_bar: ProgressBar | None = None


def set_progress_bar(bar: ProgressBar | None) -> None:
    """The progress bar on the console now, which log lines move out of the way; None when there is none."""
    global _progress_bar
    _progress_bar = bar


class ConsoleHandler(logging.StreamHandler):
    """Writes to the stdout of the moment (so pytest's capture and redirections see it)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(EscapingFormatter(_FORMAT, datefmt="%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        bar = _progress_bar
        if bar is None:
            super().emit(record)
            return
        with bar.suspended():
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        # `python train.py | head`: a closed pipe is not worth a traceback per log line.
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            return
        super().handleError(record)


def get_logger() -> logging.Logger:
    """The framework's logger, with one console handler installed once (never `print`, never the root logger)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(handler, ConsoleHandler) for handler in logger.handlers):
        logger.addHandler(ConsoleHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class EscapingFormatter(logging.Formatter):
    """Formats a record, then escapes every control character but the newline: a value read from disk (a run id, a
    pointer, a file name) can never put a terminal escape sequence on the console or into the log file."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_terminal(super().format(record), keep_newlines=True)


class RunLogFile(logging.FileHandler):
    """The log file of the run a process is working on (one at a time), never opened through a symlink."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8")
        self.setFormatter(EscapingFormatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        self._failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        # A full disk: say it once on the console, not a traceback per log line; the console still gets every line.
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            self._cannot_write(error)
            return
        super().handleError(record)

    def close(self) -> None:
        # The lines still buffered cannot reach a full disk either: said once, never raised over the run's outcome.
        try:
            super().close()
        except OSError as error:
            self._cannot_write(error)

    def _cannot_write(self, error: OSError) -> None:
        if not self._failed:
            print(f"perdure: cannot write the log file {self.baseFilename}: {error}", file=sys.stderr)
        self._failed = True

    def _open(self):  # noqa: ANN202 - logging.FileHandler's own hook
        # O_NOFOLLOW: a symlink (or a FIFO) planted under the log's name is refused, never written through.
        return os.fdopen(open_writable(self.baseFilename, append=True), "a", encoding=self.encoding)


def attach_log_file(path: Path) -> logging.Handler:
    """Mirror everything the console shows into `path`, replacing the log file of an earlier run in this process."""
    logger = get_logger()
    for handler in [h for h in logger.handlers if isinstance(h, RunLogFile)]:
        logger.removeHandler(handler)
        handler.close()
    ensure_dir(path.parent)
    handler = RunLogFile(path)
    logger.addHandler(handler)
    return handler


def record_error(handler: logging.Handler | None, error: BaseException) -> None:
    """Write the error that ends a run, with its traceback, into the run's log file (`handler`) alone: the console
    shows it once already (the interpreter's, or perdure's excepthook for its own errors)."""
    if handler is None:
        return
    logger = get_logger()
    cause = (type(error), error, error.__traceback__)
    args = (type(error).__name__, error)
    handler.handle(logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "the run failed: %s: %s", args, cause))


def detach_log_file(handler: logging.Handler | None) -> None:
    """Stop mirroring into a run's log file (its attempt is over): later runners in this process log elsewhere."""
    if handler is not None:
        get_logger().removeHandler(handler)
        handler.close()


class EarlyRecords(logging.Handler):
    """Holds what was logged before the run's log file exists, so the file still gets everything the console got.

    `owner` is the object (a runner) the records are kept for: `drop_orphans` removes the handlers of owners that no
    longer exist (a runner built, never trained, and dropped). At most `limit` records are kept.
    """

    def __init__(self, owner: object | None = None, limit: int = 10_000) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.limit = limit
        self._owner = weakref.ref(owner) if owner is not None else None

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.records) < self.limit:
            self.records.append(record)

    def replay_into(self, handler: logging.Handler) -> None:
        for record in self.records:
            handler.handle(record)
        self.records.clear()

    @property
    def orphaned(self) -> bool:
        return self._owner is not None and self._owner() is None


def drop_orphaned_early_records() -> None:
    """Remove the early-record handlers whose runner is gone (built, never trained or closed, then dropped)."""
    logger = get_logger()
    for handler in [h for h in logger.handlers if isinstance(h, EarlyRecords) and h.orphaned]:
        logger.removeHandler(handler)
