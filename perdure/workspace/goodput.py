"""Goodput: where an attempt's (and a run's) wall time went, from the raw clock the training process records.

The runner's clock (`perdure.runners.goodput.GoodputClock`) writes, into the attempt's sidecar entry, a raw record
`goodput_clock`: the process's start, the seconds of start-up, restore, compile (the attempt's first step),
evaluation and checkpoint stall, the seconds and count of the other training steps, the step reached and the last
step committed by a checkpoint, and when the record was taken. From it this module derives the attempt's `goodput`,
`{"fraction", "seconds": {part: s}}`, whose parts add up to the attempt's wall time (process start to end):

    startup           process start to the model built (imports, distributed init, the user's __init__)
    restore           loading the checkpoint the attempt resumed from
    compile           the attempt's first training step (torch.compile, allocator and kernel warm-up)
    kept_training     training steps whose result a checkpoint kept
    lost_training     training steps after the last checkpoint the next attempt resumed from (steps x step time)
    evaluation        evaluations in the loop (and the one a resumed position still owed)
    checkpoint_stall  time the loop was blocked by saves (the whole save when synchronous, the snapshot when async)
    other             the rest: attempt bookkeeping, building loaders, log lines, the drain and export at the end

`fraction` is kept_training / wall time. A run's goodput adds its attempts and the gaps between them (`queue`: from
one attempt's end to the next one's process start, when both are known).

Pure functions of plain data: the sidecar and `perdure runs` call them, nothing here reads a clock or a file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

ATTEMPT_PARTS = (
    "startup",
    "restore",
    "compile",
    "kept_training",
    "lost_training",
    "evaluation",
    "checkpoint_stall",
    "other",
)
RUN_PARTS = (*ATTEMPT_PARTS, "queue")
_TIMED = ("startup", "restore", "compile", "evaluation", "checkpoint_stall")
_CLOCK_NUMBERS = (*_TIMED, "process_started", "at", "training", "steps_timed", "step", "committed_step")


def clock_is_valid(clock: Any) -> TypeGuard[Mapping[str, Any]]:
    """Whether `clock` is a raw record this module can read: an object holding every field as a finite number."""
    if not isinstance(clock, Mapping):
        return False
    return all(_finite(clock.get(key)) is not None for key in _CLOCK_NUMBERS)


def step_time(clock: Mapping[str, Any]) -> float:
    """Seconds per training step of the attempt (its steps after the first); the first step's when it ran only that."""
    steps = float(clock["steps_timed"])
    if steps > 0:
        return float(clock["training"]) / steps
    return float(clock["compile"]) if float(clock["step"]) > float(clock["committed_step"]) else 0.0


def attempt_goodput(clock: Mapping[str, Any], *, ended: float, reached_step: int, kept_step: int) -> dict[str, Any]:
    """The attempt's goodput from its raw `clock`, the attempt having ended at POSIX time `ended` after training up to
    `reached_step`, of which the steps up to `kept_step` were kept (the step the next attempt resumed from, or the last
    committed checkpoint while there is none).

    An attempt that trained past its last record (a SIGKILL ends it between two records: `reached_step` comes from
    its heartbeats) was training from that record to its end. The lost part is the training time after the step
    the record says was last committed when that is the step kept (`committed_training`), else the lost steps at the
    attempt's mean step time. Returns `{"fraction", "seconds": {part: s}, "lost_steps", "step_time"}`.
    """
    per_step = step_time(clock)
    training = float(clock["training"])
    if reached_step > int(clock["step"]):
        training += max(ended - float(clock["at"]), 0.0)
    lost_steps = max(reached_step - kept_step, 0)
    committed_training = _finite(clock.get("committed_training"))
    if kept_step == int(clock["committed_step"]) and committed_training is not None:
        lost = training - committed_training if lost_steps else 0.0
    else:
        first_step = int(clock["step"]) - int(clock["steps_timed"])  # the compile step: timed as compile, kept or not
        lost = max(lost_steps - (1 if kept_step < first_step <= reached_step else 0), 0) * per_step
    lost = min(max(lost, 0.0), training)
    seconds = {part: float(clock[part]) for part in _TIMED}
    seconds["kept_training"] = training - lost
    seconds["lost_training"] = lost
    wall = max(ended - float(clock["process_started"]), 0.0)
    seconds["other"] = max(wall - sum(seconds.values()), 0.0)
    ordered = {part: round(seconds[part], 6) for part in ATTEMPT_PARTS}
    return {
        "fraction": kept_fraction(ordered),
        "seconds": ordered,
        "lost_steps": lost_steps,
        "step_time": round(per_step, 6),
    }


def run_goodput(attempts: Sequence[Mapping[str, Any]], parse_time: Any) -> dict[str, Any] | None:
    """A run's goodput: the sum of its attempts' parts plus `queue`, the gaps between an attempt's end and the next
    one's process start (`parse_time` turns the sidecar's stamps into POSIX times, None when not one). None when no
    attempt has a goodput (a run recorded before perdure measured it)."""
    totals = dict.fromkeys(RUN_PARTS, 0.0)
    previous_end: float | None = None
    counted = False
    for attempt in attempts:
        goodput = attempt.get("goodput")
        if not is_goodput(goodput):
            previous_end = None
            continue
        counted = True
        for part, value in goodput["seconds"].items():
            if part in totals:
                totals[part] += value
        started = parse_time(attempt.get("process_started"))
        if previous_end is not None and started is not None:
            totals["queue"] += max(started - previous_end, 0.0)
        ended = parse_time(attempt.get("ended"))
        previous_end = ended if ended is not None else None
    if not counted:
        return None
    seconds = {part: round(value, 6) for part, value in totals.items()}
    return {"fraction": kept_fraction(seconds), "seconds": seconds}


def kept_fraction(seconds: Mapping[str, float]) -> float:
    """The share of the wall time (the recorded parts added up) that was kept training, rounded as recorded. An
    attempt's and a run's are computed alike from their recorded parts, so a run of one attempt shows the attempt's
    fraction exactly (the unrounded wall differs from the rounded parts' sum in the last digit)."""
    wall = sum(seconds[part] for part in RUN_PARTS if part in seconds)
    return round(seconds["kept_training"] / wall, 6) if wall > 0 else 0.0


def is_goodput(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """Whether `value` is a goodput record: `{"fraction": number, "seconds": {part: number}}`."""
    if not isinstance(value, Mapping) or _finite(value.get("fraction")) is None:
        return False
    seconds = value.get("seconds")
    return isinstance(seconds, Mapping) and all(_finite(number) is not None for number in seconds.values())


def format_fraction(goodput: Any) -> str:
    """`73.4%` for a goodput record, `-` for none."""
    return f"{100 * goodput['fraction']:.1f}%" if is_goodput(goodput) else "-"


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
