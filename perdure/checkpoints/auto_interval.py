"""`ckpt.interval auto`: the checkpoint interval that minimises the expected time lost, from measurements.

Young's first-order optimum (J. W. Young, 1974; J. T. Daly, 2006) for a save that stalls training `stall` seconds and
interruptions every `mtbf` seconds on average is

    interval = sqrt(2 x stall x mtbf)

of training between two saves. perdure clamps it, then turns it into optimizer steps:

    at least 10 x stall     saves never take more than about a tenth of the training time, however often the run
                            is interrupted (a short MTBF alone would ask for saves back to back)
    at most mtbf / 2        at least two checkpoints per expected interruption (the formula is first-order and
                            underestimates the loss when the interval nears the MTBF); the lower bound wins when
                            the two cross
    at least 1 step, at most MAX_STEPS steps

A pure function of its inputs: the runner decides only at checkpoint boundaries and stores the decision (and its
inputs) in the checkpoint's state, so a resumed run keeps the schedule of the checkpoint it resumed from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from perdure.config_checks import register_section_check
from perdure.errors import ConfigError

AUTO = "auto"
FIRST_AUTO_STEPS = 100  # the first save of `auto`, before a save's stall has been measured
MIN_STALL_MULTIPLE = 10.0
MAX_STEPS = 1_000_000


@dataclass(frozen=True)
class IntervalChoice:
    """An `auto` interval and what it was chosen from (seconds; `clamp` names the bound that applied, if one did)."""

    steps: int
    seconds: float
    stall_s: float
    mtbf_s: float
    step_time_s: float
    clamp: str | None

    def describe(self) -> str:
        clamped = f", clamped to {self.clamp}" if self.clamp else ""
        return (
            f"{self.steps} steps ({self.seconds:.3g} s = sqrt(2 x stall {self.stall_s:.3g} s x MTBF "
            f"{self.mtbf_s:.3g} s){clamped}; step time {self.step_time_s:.3g} s)"
        )


def young_daly_seconds(stall_s: float, mtbf_s: float) -> float:
    """sqrt(2 x stall x MTBF): the training seconds between saves that minimise the expected time lost."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def choose_interval(*, stall_s: float, mtbf_s: float, step_time_s: float) -> IntervalChoice:
    """The `auto` interval in steps for a save stalling `stall_s`, interruptions every `mtbf_s` and steps of
    `step_time_s` seconds (all > 0; an infinite MTBF gives `MAX_STEPS`)."""
    if not (stall_s > 0 and mtbf_s > 0 and step_time_s > 0):
        raise ValueError(f"stall {stall_s}, MTBF {mtbf_s} and step time {step_time_s} must all be > 0")
    seconds, clamp = young_daly_seconds(stall_s, mtbf_s), None
    if seconds > mtbf_s / 2:
        seconds, clamp = mtbf_s / 2, "MTBF / 2"
    if seconds < MIN_STALL_MULTIPLE * stall_s:
        seconds, clamp = MIN_STALL_MULTIPLE * stall_s, f"{MIN_STALL_MULTIPLE:g} x stall"
    steps = seconds / step_time_s
    if steps < 1:
        steps, clamp = 1, "1 step"
    elif steps > MAX_STEPS or not math.isfinite(steps):
        steps, clamp = MAX_STEPS, f"{MAX_STEPS} steps"
    return IntervalChoice(round(steps), seconds, stall_s, mtbf_s, step_time_s, clamp)


def check_interval(interval: object, mtbf: object, training_mode: str) -> None:
    """`ckpt.interval` (None, a count >= 1 or "auto") and `ckpt.mtbf` (None or seconds > 0); `auto` needs a budget
    in steps. Raises `ConfigError` naming the key, the value and the fix."""
    if interval == AUTO:
        if training_mode != "steps":
            raise ConfigError(
                "ckpt.interval", interval, "auto works in step mode (--steps N); in epoch mode give a number of epochs"
            )
    elif interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 1):
        raise ConfigError("ckpt.interval", interval, "use a number of steps (epochs) >= 1, auto, or None")
    if mtbf is not None and (isinstance(mtbf, bool) or not isinstance(mtbf, (int, float)) or not mtbf > 0):
        raise ConfigError("ckpt.mtbf", mtbf, "use seconds > 0 between interruptions, or None (measured from the run)")


register_section_check(
    "ckpt.interval", lambda config, get: check_interval(get("ckpt.interval"), get("ckpt.mtbf"), config.training_mode())
)
