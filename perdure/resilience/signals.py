"""Preemption signals: a handler that only sets a flag; the training loop acts on it at a step boundary."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class PreemptionHandler:
    """Turns SIGTERM, SIGUSR1 (SLURM's `--signal` pre-warning) and a first SIGINT into a stop request.

    Nothing is saved inside the handler: it records the signal, and the loop finishes the current optimizer step,
    takes a forced checkpoint and exits with 128 + signal. A second SIGINT exits at once (status 130) — committed
    checkpoints stay valid, since every commit is atomic; an interrupted save is quarantined at the next start.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = PREEMPTION_SIGNALS) -> None:
        self.signals = signals
        self.received: int | None = None
        # What `signal.signal` gave back: a handler, SIG_DFL / SIG_IGN, or None (one installed outside Python).
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def install(self) -> bool:
        """Install the handlers; returns False (and does nothing) outside the main thread, where Python forbids it."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._handle)
        return True

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            os._exit(128 + signal.SIGINT)
        if self.received is None:
            self.received = signum
