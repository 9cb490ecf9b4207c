"""The `perdure` logger: plain lines on the console, the same lines in the run's log file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAME = "perdure"
_FORMAT = "%(asctime)s %(levelname)s %(message)s"


class ConsoleHandler(logging.StreamHandler):
    """Writes to the stdout of the moment (so pytest's capture and redirections see it)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


def get_logger() -> logging.Logger:
    """The framework's logger, with one console handler installed once (never `print`, never the root logger)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(handler, ConsoleHandler) for handler in logger.handlers):
        logger.addHandler(ConsoleHandler())
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


def attach_log_file(path: Path) -> logging.Handler:
    """Mirror everything the console shows into `path`; returns the handler so the runner can detach it."""
    logger = get_logger()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return handler
