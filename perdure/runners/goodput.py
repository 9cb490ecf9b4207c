"""GoodputClock: the training process's own account of where its time goes, from the process's start.

The runner notes a few moments (the model built, the restore, the loop's start, each optimizer step, the time an
evaluation or a save blocked the loop, each committed checkpoint); `record()` returns the raw record the sidecar keeps
in the attempt's entry (`goodput_clock`), from which `perdure.workspace.goodput` derives the parts. Per step the loop
pays one `perf_counter()` and a few additions.

The process's start is the kernel's record of it (`/proc/self/stat`), so imports and the distributed start-up before
perdure runs any code count too; where that is not readable, the moment perdure was imported stands in.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from perdure.checkpoints.commit import CHECKPOINT_PATTERN

_IMPORTED = time.time()


def process_start_time() -> float:
    """POSIX time at which this process started (Linux: from /proc, to a clock tick); else when perdure was
    imported."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read(4096).rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, in clock ticks after boot (fields 1-2 are before the ')')
        since_boot = ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


class GoodputClock:
    """One process's timings for the attempt it runs; made with the runner (rank 0's are recorded)."""

    def __init__(self, step: int = 0, process_started: float | None = None) -> None:
        self.process_started = process_start_time() if process_started is None else process_started
        # The process start as a duration of the monotonic clock, which every later timing uses.
        self._origin = time.perf_counter() - max(time.time() - self.process_started, 0.0)
        self.startup = self.restore = self.compile = self.evaluation = self.checkpoint_stall = 0.0
        self.training = 0.0  # the attempt's steps after the first
        self.steps_timed = 0
        self.saves = 0  # the saves whose stall `checkpoint_stall` adds up
        self.committed_training = 0.0  # `training` when the step of the last committed checkpoint ended
        self._saving: dict[int, float] = {}  # saves not yet committed: their step -> `training` at that step
        self.step = self.committed_step = step
        self._step_mark: float | None = None  # when the step being trained began (None: the loop is not running)
        self._blocked = 0.0  # evaluation and save seconds since that mark: not the step's
        self._first_step = True
        self._built = False

    def model_built(self) -> None:
        """The user's `__init__` returned (the model exists): start-up ends here."""
        self.startup = time.perf_counter() - self._origin
        self._built = True

    def resumed_at(self, step: int) -> None:
        """The attempt starts from `step` (the checkpoint it restored, or 0), before its loop does (or a failed
        setup that never reaches it)."""
        self.step = self.committed_step = step

    @contextmanager
    def restoring(self) -> Iterator[None]:
        """Around the restore of the attempt's checkpoint."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.restore += time.perf_counter() - started

    def loop_started(self, step: int) -> None:
        """The training loop starts at `step`; the next step is the compile step."""
        self.committed_step = max(self.committed_step, step)  # the checkpoint it resumed from, or the start
        self.committed_training = 0.0
        self.step = step
        self._step_mark, self._blocked, self._first_step = time.perf_counter(), 0.0, True

    def stepped(self, step: int) -> None:
        """An optimizer step brought the run to `step` (after every step)."""
        now = time.perf_counter()
        if self._step_mark is not None:
            seconds = now - self._step_mark - self._blocked
            if self._first_step:
                self.compile += seconds
                self._first_step = False
            else:
                self.training += seconds
                self.steps_timed += 1
        self._step_mark, self._blocked, self.step = now, 0.0, step

    def blocked(self, part: str, seconds: float) -> None:
        """The loop spent `seconds` in `part` ("evaluation" or "checkpoint_stall"), not in a step."""
        if part == "evaluation":
            self.evaluation += seconds
        elif part == "checkpoint_stall":
            self.checkpoint_stall += seconds
            self.saves += 1
            self._saving[self.step] = self.training  # a save happens where a step ended
        else:
            raise ValueError(f"goodput part {part!r} is not evaluation or checkpoint_stall")
        self._blocked += seconds

    def step_time(self) -> float | None:
        """Seconds per training step of this attempt so far (its first step left out), None before a second step."""
        return self.training / self.steps_timed if self.steps_timed else None

    def elapsed(self) -> float:
        """Seconds since the process started."""
        return time.perf_counter() - self._origin

    def committed(self, name: str, step: int) -> None:
        """Checkpoint `name` committed; `step` stands in for its step when the name has none (epoch checkpoints)."""
        match = CHECKPOINT_PATTERN.match(name)
        at = int(match["step"]) if match is not None and match["step"] is not None else step
        if at >= self.committed_step and at in self._saving:
            self.committed_training = self._saving[at]
        self.committed_step = max(self.committed_step, at)
        self._saving = {pending: seconds for pending, seconds in self._saving.items() if pending > at}

    def record(self) -> dict[str, float]:
        """The raw record (`perdure.workspace.goodput`), taken now."""
        return {
            "process_started": round(self.process_started, 6),
            "at": round(self.process_started + time.perf_counter() - self._origin, 6),
            "startup": round(self.startup if self._built else self.elapsed(), 6),  # not built yet: all start-up
            "restore": round(self.restore, 6),
            "compile": round(self.compile, 6),
            "evaluation": round(self.evaluation, 6),
            "checkpoint_stall": round(self.checkpoint_stall, 6),
            "training": round(self.training, 6),
            "steps_timed": self.steps_timed,
            "step": self.step,
            "committed_step": self.committed_step,
            "committed_training": round(self.committed_training, 6),
        }
