"""What the goodput clock, the heartbeat's step and the straggler watch add to a training step (issue 36), measured
apart from the runner: each call in a tight loop (a probe wrapper would cost more than they do), and the stop check's
all-reduce on 2 gloo ranks at an ordinary step against the one at a log line. `step_overhead.py` reports it after its
rounds."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import median


def per_call_us(call: Any, calls: int = 20000) -> float:
    """Median over 5 batches of `calls` calls of `call()`'s time, in us (no probe wrapper: these calls cost well
    under a microsecond, less than a probe would add)."""
    batches = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        batches.append((time.perf_counter() - started) / calls * 1e6)
    return median(batches)


def timed(watch: Any) -> None:
    """An empty block timed as the loop times a micro-batch's `train_step`."""
    with watch.timing():
        pass


def goodput_and_straggler_calls() -> dict[str, float]:
    """us per step of what the loop calls for the goodput clock, the heartbeat's step and the straggler watch (issue
    36), each timed in a tight loop: per step one `GoodputClock.stepped`, one `Heartbeat.beat` (a store into the mapped
    page where the filesystem allows it, else a pwrite), and per micro-batch the straggler watch's `timing` context
    (its CPU path: two `perf_counter` reads, as on 2 CPU ranks)."""
    from perdure.runners.goodput import GoodputClock
    from perdure.runners.stragglers import StragglerWatch
    from perdure.workspace.heartbeat import Heartbeat

    clock, watch = GoodputClock(), StragglerWatch(0, 2)
    clock.loop_started(0)
    with tempfile.TemporaryDirectory(prefix="perdure-bench-") as tmp:
        heartbeat = Heartbeat(Path(tmp), 0)
        try:
            beat = per_call_us(lambda: heartbeat.beat(123456))
        finally:
            heartbeat.close()
    return {
        "GoodputClock.stepped": per_call_us(lambda: clock.stepped(1)),
        "Heartbeat.beat": beat,
        "StragglerWatch.timing (2 ranks, CPU)": per_call_us(lambda: timed(watch)),
    }


def _collective_worker(rank: int, port: int, rounds: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    from perdure.distributed.collectives import max_each_of_floats, max_over_ranks

    plain, at_log_line = "stop check (max_over_ranks)", "stop check at a log line (max_each_of_floats, 3 slots)"
    timings: dict[str, list[float]] = {plain: [], at_log_line: []}
    for _ in range(rounds):
        for label, call in (
            (plain, lambda: max_over_ranks(0)),
            (at_log_line, lambda: max_each_of_floats([0.0, 0.001, -1.0])),
        ):
            started = time.perf_counter()
            call()
            timings[label].append(time.perf_counter() - started)
    if rank == 0:
        results.update({label: median(samples) for label, samples in timings.items()})
    torch.distributed.destroy_process_group()


def collective_cost(rounds: int = 500) -> dict[str, float]:
    """On 2 gloo ranks: median seconds of the stop check's collective at an ordinary step and at a log line (where
    it also carries each rank's time per step)."""
    import socket

    import torch.multiprocessing as torch_mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with torch_mp.Manager() as manager:
        results = manager.dict()
        torch_mp.spawn(_collective_worker, args=(port, rounds, results), nprocs=2)
        return dict(results)


def goodput_and_straggler_target(us_per_step: float, log_interval: int) -> dict[str, Any]:
    """What the goodput clock, the heartbeat's step and the straggler watch add per step, in us and as a share of
    the runner's step: their calls, plus the log line's larger all-reduce on 2 gloo ranks / log interval."""
    each = goodput_and_straggler_calls()
    calls = sum(each.values())
    collectives = collective_cost()
    plain, at_log_line = collectives.values()
    extra_collective_us = max(at_log_line - plain, 0.0) * 1e6
    per_step = calls + extra_collective_us / log_interval
    return {
        "calls_us": each,
        "calls_us_per_step": calls,
        "collective_us": {label: value * 1e6 for label, value in collectives.items()},
        "extra_collective_us_per_log_line": extra_collective_us,
        "us_per_step": per_step,
        "share_of_step": per_step / us_per_step,
    }
