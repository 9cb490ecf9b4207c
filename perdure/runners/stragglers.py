"""StragglerWatch: which rank is slow, told at the train log lines for one small collective.

Each rank adds up its own compute time per step: the time its `train_step` calls (the forward of each micro-batch)
take, measured with CUDA events on a GPU (kernels run after the Python call returns; the events are read at the log
line, where the loop waits for the GPU anyway) and with the CPU's clock elsewhere. Backward and the optimizer step
are left out on purpose: under DDP they end in the gradient all-reduce, where every rank waits for the slowest, so
they take the same wall time on every rank and hide the one that is slow. (Under FSDP or tensor parallelism the
forward holds collectives too, so a slow rank shows less clearly there.)

At every train log line the ranks exchange that time per step in the collective that agrees on a preemption signal
anyway (the loop runs it after every step, `BaseRunner.stop_requested`): at a log line that all-reduce (MAX) carries,
besides the signal, one slot per rank, in which only that rank writes its time (the others a floor), so it returns
every rank's time; the loop's stop check right after uses the signal agreed there. So a log interval costs no
collective more than it did, only a vector of world size + 1 numbers instead of one; the first log line also gathers
the ranks' host names, once. Rank 0 logs the ranks more than `SLOW_RATIO` times slower than the median, and by more
than `SLOW_FLOOR_S` (rank, host, its time, the median); the train log line (and so `metrics.csv`) carries the ranks'
min, median and max time per step.

The stop check between log lines costs no wait once the steps are known to be short. A blocking all-reduce after
every step would make every rank wait for the slowest one more time per step than the training itself does (and, on
NCCL, wait for the GPU). So the check runs on host tensors in a gloo group of its own (beside the training's
collectives) and, when the slowest rank's wall time per step at the last log line was under `PIPELINED_BELOW_S`, it
is started after one step and read at the next check: every rank still stops at the same step, shortly after the
signal instead of at once. Steps much shorter than `CHECK_PERIOD_S` are checked every so many steps (as many as take
that long), so that tiny steps do not pay a collective each. Longer steps agree at once, so that a stop never waits a
long step for it. Until a log line has measured the steps, a check that agrees at once also carries each rank's time
since its previous check (the step just trained), and the slowest rank's decides how the next checks run, as each log
line decides again (until then: afterwards each line's mode holds until the next): so only the first steps (the first,
which compiles and warms up, and the one that measures) agree at once when log lines are far apart. A step whose ranks
agree on something else anyway (whether their gradient shards are finite) carries the signal in that collective, and its
stop check starts none (`agreed_at_this_step`).
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist

from perdure.distributed.collectives import PendingMax, all_gather_object, host_group, max_each_of_floats

SLOW_RATIO = 1.2  # a rank more than 20% slower than the median is named ...
SLOW_FLOOR_S = 0.001  # ... when that is also more than a millisecond a step (tiny forwards jitter by more than 20%)
MAX_NAMED = 4  # the slowest ranks a warning names at most
NO_TIME = -1.0  # a slot no rank filled (an all-reduce MAX keeps the one rank's own time)
NOT_TIMED: AbstractContextManager[None] = nullcontext()  # one rank: nothing to compare (reusable)
PIPELINED_BELOW_S = 1.0  # steps this short agree on a stop one step late, for no wait per step
CHECK_PERIOD_S = 0.1  # pipelined, a stop check at most every this many seconds of steps (at least every step)

logger = logging.getLogger("perdure")


class StragglerWatch:
    """One rank's side of the exchange; made with the runner, fed by the loop (`forward_took` per micro-batch,
    `exchange` at each train log line, `agreed_signal` at each stop check)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.hosts: list[str] | None = None
        self._compute = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # a GPU's forwards since the last line
        self._cuda = False
        self._last_step: int | None = None
        self._agreed: int | None = None  # the signal agreed at this step's log line, for the stop check after it
        self._pipelined = False  # agreed at each log line: the stop check is read one step after it is started
        self.check_every = 1  # pipelined: the checks that start a collective, one in so many (agreed at log lines)
        self._checks = 0
        self._pending: PendingMax | None = None  # the stop check started at the last check, pipelined
        self._group: dist.ProcessGroup | None = None  # host tensors' group (made at the first check)
        self._group_made = False
        self._line_at: float | None = None  # perf_counter at the last log line (wall time per step)
        self._check_at: float | None = None  # perf_counter at the last training step's check (the step's wall time)
        self._line_measured = False  # a log line measured the steps: its mode holds until the next line

    def start(self, step: int, device: torch.device | None = None) -> None:
        """The training loop starts at `step`, the model on `device` (a CUDA device: forwards timed with events)."""
        self._compute, self._last_step, self._events = 0.0, step, []
        self._line_at = time.perf_counter()
        self._cuda = device is not None and device.type == "cuda" and self.world_size > 1

    def timing(self) -> AbstractContextManager[None]:
        """Around one micro-batch's `train_step`: its time on this rank (a no-op with one rank)."""
        return NOT_TIMED if self.world_size == 1 else self._timed()

    @contextmanager
    def _timed(self) -> Iterator[None]:
        if self._cuda:
            began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            began.record()
            yield
            ended.record()
            self._events.append((began, ended))
        else:
            started = time.perf_counter()
            yield
            self._compute += time.perf_counter() - started

    def _own_seconds(self) -> float:
        """This rank's forward seconds since the last log line (waiting for the GPU's last one to finish)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._compute += sum(began.elapsed_time(ended) for began, ended in self._events) / 1000
            self._events = []
        seconds, self._compute = self._compute, 0.0
        return seconds

    def exchange(self, signal: int, step: int) -> dict[str, float]:
        """At a train log line of `step`, every rank: gather every rank's compute time per step since the last line
        together with the preemption signal it received (`signal`, 0: none); returns the log line's columns
        (`rank_step_time_min`, `_median`, `_max`; none with one rank or before a first interval)."""
        if self.world_size == 1:
            return {}
        steps = step - self._last_step if self._last_step is not None else 0
        own = self._own_seconds() / steps if steps > 0 else 0.0
        now = time.perf_counter()
        wall = (now - self._line_at) / steps if steps > 0 and self._line_at is not None else NO_TIME
        self._last_step, self._line_at = step, now
        if self.hosts is None:
            self.hosts = [str(host) for host in all_gather_object(socket.gethostname())]
        slots = [NO_TIME] * (self.world_size + 2)
        slots[0], slots[1], slots[2 + self.rank] = float(signal), wall, own if steps > 0 else NO_TIME
        reduced = max_each_of_floats(slots)
        self.agreed_at_this_step(int(reduced[0]))
        self._set_mode(reduced[1])  # the slowest rank's wall time per step, the same on every rank
        self._line_measured = reduced[1] >= 0
        times = reduced[2:]
        if any(seconds < 0 for seconds in times):  # a rank without a step since the last line
            return {}
        median = statistics.median(times)
        if self.rank == 0:
            self._name_slow_ranks(step, times, median)
        return {"rank_step_time_min": min(times), "rank_step_time_median": median, "rank_step_time_max": max(times)}

    def agreed_signal(self, received: int, at_once: bool = False) -> int:
        """The stop check (several ranks; every rank calls it at the same points): the signal agreed at this step's
        log line if one was, else the largest signal any rank received now, or (pipelined, module docstring) by the
        previous check. The same value on every rank. `at_once` (the checks before an evaluation's batches, which are
        few and may be long, and were not what the period was measured on): agree now, whatever the steps took."""
        if not self._group_made:
            self._group, self._group_made = host_group(), True
        now = time.perf_counter()
        wall = now - self._check_at if self._check_at is not None and not at_once else NO_TIME
        self._check_at = None if at_once else now  # an evaluation's checks measure no training step
        if self._agreed is not None:  # a collective of this step agreed already: none of its own
            agreed, self._agreed = self._agreed, None
            if self._pending is not None:
                agreed, self._pending = max(agreed, self._pending.result()[0]), None
            return agreed
        pipelined = self._pipelined and not at_once
        if pipelined:
            self._checks += 1
            if self._checks % self.check_every:  # not a check that starts a collective: the pending one waits
                return 0
        agreed = 0
        if self._pending is not None:
            agreed, self._pending = self._pending.result()[0], None
        if pipelined:  # what this rank holds now is read at the next check that starts one
            self._pending = PendingMax([received], self._group)
            return agreed
        # at once, with this rank's last step in microseconds (-1: none measured): the slowest sets the next checks'
        signal, slowest_us = PendingMax([received, round(wall * 1e6) if wall >= 0 else -1], self._group).result()
        if slowest_us >= 0 and not self._line_measured:
            self._set_mode(slowest_us / 1e6)
        return max(agreed, signal)

    def _set_mode(self, wall: float) -> None:
        """The slowest rank's wall time per step is `wall` (the same on every rank; negative: unknown): pipeline the
        next checks when it is short, starting a collective at one check in so many when it is tiny."""
        self._pipelined = 0 <= wall < PIPELINED_BELOW_S
        self.check_every = max(1, int(CHECK_PERIOD_S / wall)) if self._pipelined and wall > 0 else 1
        self._checks = 0  # the k-th check from here starts the next collective

    def agreed_at_this_step(self, signal: int) -> None:
        """A collective of this step carried every rank's preemption signal (`signal`: the largest), as the log line's
        exchange and the agreement on finite gradients do: the stop check after it reads that, with no collective of
        its own. Every rank calls it at the same points."""
        self._agreed = signal if self._agreed is None else max(self._agreed, signal)

    def _name_slow_ranks(self, step: int, times: list[float], median: float) -> None:
        slow = sorted((rank for rank, seconds in enumerate(times)
                       if seconds > SLOW_RATIO * median and seconds - median > SLOW_FLOOR_S),
                      key=lambda rank: -times[rank])  # fmt: skip
        if not slow or median <= 0:
            return
        hosts = self.hosts or ["?"] * len(times)
        named = "; ".join(
            f"rank {rank} ({hosts[rank]}) {times[rank]:.4g} s/step, {times[rank] / median:.2f}x"
            for rank in slow[:MAX_NAMED]
        )
        more = f" and {len(slow) - MAX_NAMED} more" if len(slow) > MAX_NAMED else ""
        logger.warning(
            "slow rank%s at step %d: %s%s (median of %d ranks %.4g s/step; forward time of train_step per step)",
            "s" if len(slow) > 1 else "", step, named, more, len(times), median,
        )  # fmt: skip
