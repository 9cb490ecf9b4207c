"""A one-line console progress bar (steps/s, metrics, ETA) for terminals; silent everywhere else."""

from __future__ import annotations

import math
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import IO

PROGRESS_MODES = ("auto", "bar", "lines")


class ProgressBar:
    """`step 120/1000  12% | 35.2 steps/s | loss 0.1234 | ETA 0:00:25`, redrawn in place with `\\r`.

    Drawn when `mode="bar"`, or `mode="auto"` and the stream is a terminal; with `mode="lines"` or a stream that is
    not a terminal it draws nothing at all (the runner's plain log lines every `log.interval` steps already tell the
    progress, and a log file or CI output must not fill up with redraws). The rate and the ETA are measured on the
    bar's own clock from `initial`, the step training starts from, so a resumed run shows its true speed. Redraws
    are limited to one per `min_interval` seconds; the line is cut to the terminal's width so it never wraps.

    The bar writes straight to its stream (never through `logging`, so it never reaches the log file). Whatever
    prints log lines on the same stream must take the bar out of the way first: wrap the write in `suspended()`, or
    call `clear()` before and `redraw()` after. Thread-safe.
    """

    def __init__(
        self,
        total: int | None,
        initial: int = 0,
        *,
        mode: str = "auto",
        stream: IO[str] | None = None,
        min_interval: float = 0.1,
        width: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in PROGRESS_MODES:
            raise ValueError(f"ProgressBar mode {mode!r}: use one of {', '.join(PROGRESS_MODES)}")
        self.total = total
        self.initial = initial
        self.min_interval = min_interval
        self._stream = stream
        self._width = width
        self._clock = clock
        self._started = clock()
        self._step = initial
        self._metrics: dict[str, float] = {}
        self._shown = ""  # the line on screen now, "" when none is
        self._drawn_at = -math.inf
        self._closed = False
        self._lock = threading.RLock()
        self.enabled = mode == "bar" or (mode == "auto" and _isatty(self.stream))

    @property
    def stream(self) -> IO[str]:
        """The stream drawn on: the one given, else `sys.stdout` of the moment (as the console logger uses)."""
        return self._stream if self._stream is not None else sys.stdout

    # ---- progress ----------------------------------------------------------------------------------------------

    def update(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        """Training reached `step`; `metrics` (e.g. the latest loss) replace the shown values of the same names."""
        if not self.enabled:  # nothing will be drawn (called after every step): the step alone, for `rate` / `eta`
            self._step = step
            return
        with self._lock:
            self._step = step
            if metrics:
                self._metrics.update({name: float(value) for name, value in metrics.items()})
            now = self._clock()
            finished = self.total is not None and step >= self.total
            if now - self._drawn_at >= self.min_interval or finished:
                self._draw(now)

    def rate(self) -> float | None:
        """Steps per second since `initial`, or None before the first step."""
        elapsed = self._clock() - self._started
        done = self._step - self.initial
        return done / elapsed if done > 0 and elapsed > 0 else None

    def eta(self) -> float | None:
        """Seconds left at the current rate, or None when unknown (no total, no rate yet)."""
        rate = self.rate()
        if self.total is None or rate is None:
            return None
        return max(self.total - self._step, 0) / rate

    def format(self) -> str:
        """The bar's text now (without the carriage return)."""
        parts = [f"step {self._step}"]
        if self.total:
            percent = 100.0 * min(max(self._step / self.total, 0.0), 1.0)
            parts[0] += f"/{self.total} {percent:3.0f}%"
        rate = self.rate()
        if rate is not None:
            parts.append(f"{rate:.1f} steps/s" if rate >= 1 else f"{1 / rate:.1f} s/step")
        if self._metrics:
            parts.append("  ".join(f"{name} {value:.4g}" for name, value in self._metrics.items()))
        if self.total is not None:
            eta = self.eta()
            parts.append("ETA " + ("--:--" if eta is None else str(timedelta(seconds=round(eta)))))
        return " | ".join(parts)

    # ---- sharing the terminal with log lines --------------------------------------------------------------------

    def clear(self) -> None:
        """Erase the bar's line (the cursor goes back to its start) so a log line can be printed there."""
        with self._lock:
            if self._shown:
                self._write("\r" + " " * len(self._shown) + "\r")
                self._shown = ""

    def redraw(self) -> None:
        """Draw the bar again now (after a log line was printed), if it is drawn at all."""
        with self._lock:
            self._draw(self._clock())

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """`with bar.suspended(): print_log_line()`: clears the bar, then draws it again below the line."""
        with self._lock:
            self.clear()
            try:
                yield
            finally:
                self.redraw()

    def close(self) -> None:
        """Draw the final state and end the line. Idempotent; nothing is drawn afterwards."""
        with self._lock:
            if self._closed:
                return
            self._draw(self._clock())
            if self._shown:
                self._write("\n")
                self._shown = ""
            self._closed = True

    # ---- drawing ------------------------------------------------------------------------------------------------

    def _draw(self, now: float) -> None:
        if not self.enabled or self._closed:
            return
        width = self._width or shutil.get_terminal_size(fallback=(100, 24)).columns
        line = self.format()[: max(width - 1, 10)]
        padding = " " * max(len(self._shown) - len(line), 0)  # erase what a longer previous line left
        if line + padding != self._shown:
            self._write("\r" + line + padding)
        self._shown = line + padding
        self._drawn_at = now

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken terminal must not stop training
            self.enabled = False


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False
