"""The stop check between log lines (perdure/runners/stragglers.py): every rank reads the same signal at the same
check; with short steps it is read one check after a rank received it (no wait per step), with long ones at once, and
a log line's exchange agrees at once whatever the mode. Two real gloo ranks; rank 1 alone receives SIGTERM."""

from __future__ import annotations

import signal
import time

import pytest

from perdure.distributed.collectives import max_each_over_ranks
from perdure.runners import stragglers
from tests.distributed.gloo_ranks import run_on_gloo_ranks

pytestmark = pytest.mark.timeout(120)

SIGTERM = int(signal.SIGTERM)


def agreed_at_each_check(
    rank: int,
    world_size: int,
    log_every: int,
    signal_at: int,
    slow_steps: bool,
    finite_check: bool = False,
    step_seconds: float = 0.0,
    steps: int = 10,
    period: float = 0.0,
    at_once_from: int | None = None,
) -> list[int]:
    """`steps` steps of `step_seconds`; a log line every `log_every`; rank 1 holds SIGTERM from step `signal_at`
    on; the agreed signal at each step's check, then the checks' period set by the first log line. `finite_check`:
    each step's ranks agree on their gradients first (the parallel stack's `agree_finite`), in a collective that
    carries the signal. `period` sets how often pipelined checks start a collective (0: every check). From step
    `at_once_from` on, the checks are an evaluation's (`at_once`)."""
    if slow_steps:  # steps longer than the bound: every check agrees at once
        stragglers.PIPELINED_BELOW_S = 0.0
    stragglers.CHECK_PERIOD_S = period
    watch = stragglers.StragglerWatch(rank, world_size)
    watch.start(0)
    agreed, periods = [], []
    for step in range(1, steps + 1):
        time.sleep(step_seconds)
        received = SIGTERM if rank == 1 and step >= signal_at else 0
        if finite_check:
            watch.agreed_at_this_step(max_each_over_ranks([0, received])[1])
        if step % log_every == 0:
            watch.exchange(received, step)
            periods.append(watch.check_every)
        at_once = at_once_from is not None and step >= at_once_from
        agreed.append(watch.agreed_signal(received, at_once=at_once))
    return [*agreed, periods[0]]


def first_stop(agreed: list[int]) -> int:
    return next(step for step, value in enumerate(agreed[:-1], start=1) if value)


def test_short_steps_agree_one_check_late_and_every_rank_reads_the_same():
    """After the first log line (step 2) the steps are short: the signal of step 5 is read at step 6 on both ranks."""
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 2, 5, False)
    assert ranks[0] == ranks[1]
    # step 5 is odd (no log line): started there, read at step 6 (also a log line, which agrees at once anyway)
    assert first_stop(ranks[0]) == 6
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 4, 5, False)
    assert ranks[0] == ranks[1] and first_stop(ranks[0]) == 6  # no log line at 5 or 6: read one check late
    assert ranks[0][5:8] == [SIGTERM] * 3  # steps 6-8 (the log line's exchange at 8 starts no check of its own)


def test_before_a_step_is_measured_and_with_long_steps_the_check_agrees_at_once():
    """The first check has no step time (the first step compiles and warms up), the second measures one: both agree at
    once; with long steps every check does."""
    for signal_at in (1, 2):
        ranks = run_on_gloo_ranks(2, agreed_at_each_check, 8, signal_at, False)
        assert ranks[0] == ranks[1] and first_stop(ranks[0]) == signal_at
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 2, 5, True)
    assert ranks[0] == ranks[1] and first_stop(ranks[0]) == 5
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 8, 5, True)  # long steps measured before the first log line
    assert ranks[0] == ranks[1] and first_stop(ranks[0]) == 5


def test_short_steps_measured_by_the_checks_are_pipelined_before_the_first_log_line():
    """Log lines far apart (every 8 steps): the check of step 2 carries each rank's step time, short, so the checks
    after it are pipelined without waiting for a log line: the signal of step 3 is read at step 4 on both ranks (until
    2026-11-29 every check before the first log line agreed at once, a blocking all-reduce per step)."""
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 8, 3, False)
    assert ranks[0] == ranks[1] and first_stop(ranks[0]) == 4
    assert ranks[0][3:8] == [SIGTERM] * 5


def test_a_step_whose_ranks_agree_on_their_gradients_stops_at_once_with_short_steps():
    """The finite-gradient agreement carries the signal: the stop check reads it in the same step, pipelined or not."""
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 2, 5, False, True)
    assert ranks[0] == ranks[1] and first_stop(ranks[0]) == 5
    assert all(value == SIGTERM for value in ranks[0][4:-1])


def test_tiny_steps_start_a_check_only_every_so_many_steps():
    """Steps of 5 ms against a period of 50 ms: one check in k (about 10, fewer on a loaded machine) starts a
    collective; the signal of step 13 goes out with the first one after it (check k, step 12 + k) and is read at the
    next (step 12 + 2k), on both ranks, unless the log line of step 24 agrees on it first."""
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 12, 13, False, False, 0.005, 33, 0.05)
    assert ranks[0] == ranks[1]
    check_every = ranks[0][-1]
    assert 2 <= check_every <= 10, ranks[0]
    assert first_stop(ranks[0]) == min(12 + 2 * check_every, 24), ranks[0]


def test_an_evaluations_checks_agree_at_once_with_short_steps():
    """The checks before an evaluation's batches agree at once even where the training's steps are pipelined (an
    evaluation has few, long batches: read one check late, a signal could outlast it); here the signal of step 5, read
    at step 6 by the training's checks, is read at step 5."""
    ranks = run_on_gloo_ranks(2, agreed_at_each_check, 4, 5, False, False, 0.0, 10, 0.0, 5)
    assert ranks[0] == ranks[1] and first_stop(ranks[0]) == 5
