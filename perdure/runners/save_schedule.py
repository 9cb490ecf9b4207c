"""SaveSchedule: when the loop's interval saves happen, every `ckpt.interval` steps or as `auto` decides.

With `ckpt.interval auto` (step mode) the step of the next interval save is decided at each interval save, just before
the state is snapshotted, from the mean stall of the run's saves so far (`RunnerState.save_stall_s`), this attempt's
step time and the MTBF (`ckpt.mtbf`, else the run's own: its attempts' wall time over their interruptions, at least
one, so a run never interrupted yet counts its time so far), with `perdure.checkpoints.auto_interval.choose_interval`.
The decision is rank 0's (broadcast: every rank saves at the same step) and is stored in the checkpoint with its
inputs, so a run resumed from that checkpoint saves next at the same step; its later decisions use its own
measurements. Until a save has been measured the first one comes `FIRST_AUTO_STEPS` steps after the start. The
interval is logged, with its inputs, whenever it changes. Saves never change the training itself, and evaluations
keep their own cadence (`eval.interval`, default 500 steps under `auto`), so resumes stay bit-exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from perdure.checkpoints.auto_interval import AUTO, FIRST_AUTO_STEPS, choose_interval
from perdure.distributed.collectives import broadcast_object
from perdure.runners.goodput import GoodputClock
from perdure.runners.state import RunnerState

logger = logging.getLogger("perdure")


class SaveSchedule:
    """Made with the runner; `due(count)` at each step (epoch) end, `plan()` right before each interval save."""

    def __init__(
        self,
        interval: int | str | None,
        *,
        mtbf_s: float | None,
        state: RunnerState,
        clock: GoodputClock,
        run_mtbf: Callable[[], float | None],
        default: int,
    ) -> None:
        self.auto = interval == AUTO
        self.every = default if interval is None or interval == AUTO else int(interval)
        self.mtbf_s = mtbf_s
        self.state = state
        self.clock = clock
        self.run_mtbf = run_mtbf  # rank 0's measure of the run's MTBF (the other ranks' is never used)
        self._stall_seen, self._saves_seen = 0.0, 0
        self._interval: int | None = None  # the last interval chosen (and logged)

    @classmethod
    def for_runner(cls, runner: Any, default: int) -> SaveSchedule:
        """The schedule of a runner whose config, state and telemetry exist, for a loop whose default interval is
        `default` (its cadence's)."""
        ckpt, telemetry = runner.config.ckpt, runner.telemetry
        return cls(ckpt.interval, mtbf_s=ckpt.mtbf, state=runner.state, clock=telemetry.goodput,
                   run_mtbf=telemetry.run_mtbf, default=default)  # fmt: skip

    def due(self, count: int) -> bool:
        """Whether the interval save of step (epoch) `count` is due."""
        if not self.auto:
            return count % self.every == 0
        planned = self.state.auto_save_step
        return count >= (planned if planned is not None else FIRST_AUTO_STEPS)

    def plan(self) -> None:
        """`auto`, every rank, right before an interval save at the current step: fold the saves measured since the
        last plan into the run's mean stall, decide the next save's step (rank 0's decision) and put both in the state
        the save snapshots. Fixed intervals: nothing."""
        if not self.auto:
            return
        state, clock = self.state, self.clock
        new_saves = clock.saves - self._saves_seen
        if new_saves > 0:
            new_stall = clock.checkpoint_stall - self._stall_seen
            total = (state.save_stall_s or 0.0) * state.save_stalls + new_stall
            state.save_stalls += new_saves
            state.save_stall_s = total / state.save_stalls
        self._stall_seen, self._saves_seen = clock.checkpoint_stall, clock.saves
        mtbf = self.mtbf_s if self.mtbf_s is not None else self.run_mtbf()
        step_time = clock.step_time()
        choice = None
        if state.save_stall_s and mtbf and step_time:
            choice = choose_interval(stall_s=state.save_stall_s, mtbf_s=mtbf, step_time_s=step_time)
        steps = broadcast_object(choice.steps if choice is not None else FIRST_AUTO_STEPS)
        state.auto_save_step = state.global_step + steps
        if choice is not None and steps != self._interval:  # the first choice, or a new one
            source = "from ckpt.mtbf" if self.mtbf_s is not None else "measured from the run's attempts"
            logger.info("checkpoint interval (ckpt.interval auto): %s; MTBF %s", choice.describe(), source)
            self._interval = steps
