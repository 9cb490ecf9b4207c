"""Crash loops: a run whose last attempts each ended without a new checkpoint is not started again.

A bug that raises at the same step fails every attempt; a requeueing wrapper, `perdure sweep --retries` or a SLURM
requeue would start it forever. So when `resilience.max_attempts_without_progress` attempts in a row each ended
(failed, hung, killed) without committing a checkpoint beyond the one they started from, the next launch refuses to
train: rank 0 marks the run `stuck` in its sidecar, logs those attempts and their errors, and every rank exits
`STUCK_EXIT` (93, "do not requeue") before the model's optimizer state is built.

Progress is read from what is on disk, not from bookkeeping: every attempt records the step it resumed from, and an
attempt made no progress when the checkpoint this launch resumes from is still the one it started from. An attempt
that was preempted (it saved where it stopped) or completed ends the count, and so does the first attempt a
`perdure sweep retry` started (`RETRY_ENV`); a larger `max_attempts_without_progress` lets the run try again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from perdure.errors import RunStuckError
from perdure.safe_io import escape_terminal
from perdure.wording import counted
from perdure.workspace.sidecar import SIDECAR_NAME, SidecarError, read_sidecar

STUCK_EXIT = 93
# Set to "1" by `perdure sweep` for the first launch of a job after `perdure sweep retry`: the count starts over.
RETRY_ENV = "PERDURE_RETRY"
# Attempt statuses that say nothing was saved where the attempt stopped. `running`: an attempt that never recorded its
# end (killed); the launch that reads it holds the run lock, so it is not alive.
WITHOUT_PROGRESS = ("failed", "hung", "interrupted", "running")


def is_retry(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this launch is the first one after `perdure sweep retry` (the count of attempts starts over)."""
    return (os.environ if environ is None else environ).get(RETRY_ENV) == "1"


def attempts_without_progress(attempts: Sequence[Mapping[str, Any]], resume_step: int) -> list[Mapping[str, Any]]:
    """The last attempts, oldest first, that each ended without progress: they failed, hung or were killed, and the
    step this launch resumes from (`resume_step`, 0 for a fresh start) is the step each of them started from. The
    count stops before an attempt that did otherwise, and at (including) the first attempt of a retry."""
    found: list[Mapping[str, Any]] = []
    for attempt in reversed(attempts):
        if attempt.get("status") not in WITHOUT_PROGRESS or attempt.get("resumed_step") != resume_step:
            break
        found.append(attempt)
        if attempt.get("retry") is True:
            break
    return found[::-1]


def refuse_if_stuck(
    run_dir: Path, *, limit: int, resume_step: int, logger: logging.Logger, open_sidecar: Callable[[], Any]
) -> None:
    """Rank 0, holding the run lock, before anything is built: when the last `limit` attempts of the run in `run_dir`
    made no progress, mark it `stuck` (in the `Sidecar` that `open_sidecar` returns), log those attempts and raise
    `RunStuckError`. A retry launch (`is_retry`) is never refused; a run without a readable sidecar has no attempts."""
    if is_retry():
        return
    try:
        attempts = read_sidecar(Path(run_dir) / SIDECAR_NAME)["attempts"]
    except SidecarError:
        return
    stalled = attempts_without_progress(attempts, resume_step)
    if len(stalled) < limit:
        return
    where = f"step {resume_step}" if resume_step else "the start"
    reason = (
        f"{counted(len(stalled), 'attempt')} in a row ended without a checkpoint beyond {where} "
        f"(resilience.max_attempts_without_progress={limit})"
    )
    logger.error("run %s is stuck: %s; not training again. Its attempts:", run_dir, reason)
    for attempt in stalled:
        logger.error(
            "  %s  %s at step %s: %s",
            escape_terminal(attempt.get("started")),  # read from disk: escaped for the terminal
            escape_terminal(attempt.get("status")),
            attempt.get("last_step"),
            escape_terminal(attempt.get("exit_reason") or "no exit recorded"),
        )
    logger.error(
        "fix the cause, then rerun with a larger --resilience.max_attempts_without_progress (or `perdure sweep retry` "
        "its job); exiting %d (do not requeue)",
        STUCK_EXIT,
    )
    sidecar = open_sidecar()
    sidecar.mark_stuck(reason)
    sidecar.write()
    raise RunStuckError(f"run {run_dir} is stuck: {reason}")
