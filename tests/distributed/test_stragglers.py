"""Four gloo ranks, one slowed by a sleep in the training script's own `train_step`: the log names that rank (with
its host, its time and the median) within two log intervals, and metrics.csv keeps the ranks' min / median / max."""

from __future__ import annotations

import csv
import re
import socket

import pytest

from tests.runs import assert_all_ok, run_dir, run_ranks

pytestmark = pytest.mark.timeout(240)


def test_the_slow_rank_is_named_within_two_log_intervals(tmp_path):
    args = ("--steps", "12", "--log.interval", "4", "--ckpt.interval", "12", "--eval.interval", "1000")
    results = run_ranks(4, "resumable.py", tmp_path, *args, STEP_SLEEP="0.05", SLOW_RANK="2")
    assert_all_ok(results)
    log = results[0].stdout
    named = re.findall(
        r"slow rank at step (\d+): rank (\d+) \((.+?)\) ([\d.]+) s/step.*median of 4 ranks ([\d.]+)", log
    )
    assert named, log
    step, rank, host, seconds, median = named[0]
    assert int(step) <= 8 and rank == "2" and host == socket.gethostname()
    assert float(seconds) >= 0.05 > 1.2 * float(median)
    assert {match[1] for match in named} == {"2"}  # no other rank is named
    with open(run_dir(tmp_path) / "metrics.csv") as rows:
        columns = {(int(row["step"]), row["name"]): float(row["value"]) for row in csv.DictReader(rows)}
    for at in (4, 8, 12):
        assert columns[at, "rank_step_time_max"] >= 0.05 > 1.2 * columns[at, "rank_step_time_median"]
        assert columns[at, "rank_step_time_min"] <= columns[at, "rank_step_time_median"]
