"""The hang watch: a rank that has not finished a training step within `dist.step_timeout` is named, and the job
stops within about that limit instead of waiting `dist.timeout` in a collective.

The training loop notes its phase in memory at a few points of every step (`fetching` around the loader, `during`
around evaluations and saves, `enter("closing")` after the loop): a tuple assignment, no I/O. A daemon thread per
rank publishes it as the rank's heartbeat (`perdure.resilience.rank_heartbeat`) within `TICK_SECONDS` of a change
(so a stopped rank's last heartbeat says where it stopped), and every `period` seconds anyway. When this
rank's own phase is older than half the limit, the thread also reads every rank's heartbeat and looks for the rank
furthest behind (`find_hang`): when that rank is in a step phase (data_loading, training_step, end_of_step) and the
step has lasted longer than the limit since the last rank entered it, the job is hung. Evaluations, saves (which
have `ckpt.hang_warning_s`), start-up, restore and the first step of an attempt never count: `dist.timeout` bounds
them.

The first rank to see the hang publishes the verdict (`hangs/<attempt>/verdict.json`, created atomically: one rank
wins) and logs the one line naming the rank; every live rank that sees the verdict writes its Python stacks
(faulthandler, all threads) beside it, rank 0 records the attempt as `hung` in the sidecar (or the reporting rank
does, when rank 0 is the stopped one), and the process exits with `HUNG_EXIT_CODE`: its main thread may be blocked in
a collective, so no save is attempted and nothing waits for it. The launcher (torchrun) then stops the other ranks,
and the next launch resumes from the last committed checkpoint.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

from perdure.atomic import temporary_sibling
from perdure.resilience.rank_heartbeat import (
    EXEMPT_PHASES,
    HeartbeatWriter,
    RankBeat,
    heartbeat_path,
    read_beat,
)
from perdure.runners.state import RunnerState
from perdure.safe_io import create_new, ensure_dir, read_json

HUNG_EXIT_CODE = 92  # a rank of the job hung: requeue (on other nodes, if it was one); 93 is "do not requeue"
HANGS_DIR = "hangs"
VERDICT_NAME = "verdict.json"
ACT_SECONDS = 10.0  # what a rank writes before exiting (stacks, the sidecar) may take this long, then it exits anyway
TICK_SECONDS = 0.05  # how stale a live rank's heartbeat may be: a stopped rank's last one says where it stopped
MAX_NAMED = 4  # ranks named in the line; more are counted

logger = logging.getLogger("perdure")
Method = TypeVar("Method", bound=Callable[..., Any])


@dataclass(frozen=True)
class Hang:
    """What `find_hang` found: the ranks behind the others (`named`), which of them no longer beat (`frozen`)."""

    named: tuple[RankBeat, ...]
    frozen: tuple[int, ...]
    phase: str
    step: int
    seconds: float


@dataclass(frozen=True)
class HangVerdict:
    """The published decision every live rank acts on."""

    attempt: str
    line: str
    reporter: int
    named: tuple[int, ...]
    frozen: tuple[int, ...]

    @classmethod
    def from_record(cls, record: Any) -> HangVerdict | None:
        if not isinstance(record, dict) or not isinstance(record.get("line"), str):
            return None
        ranks: list[Any] = [record.get("named"), record.get("frozen")]
        if not all(isinstance(r, list) and all(isinstance(x, int) for x in r) for r in ranks):
            return None
        if not isinstance(record.get("reporter"), int) or not isinstance(record.get("attempt"), str):
            return None
        return cls(record["attempt"], record["line"], record["reporter"], tuple(ranks[0]), tuple(ranks[1]))


def find_hang(beats: dict[int, RankBeat | None], *, now: float, limit: float, stale_after: float) -> Hang | None:
    """The hang in `beats` (every rank's record, None where there is none of this attempt), or None.

    The ranks furthest behind decide: nothing is hung while any of them is in an exempt phase (the others wait for its
    save or evaluation), or has not finished a step of this attempt, or entered its step less than `limit` seconds
    ago (the step can only have started when the last of them entered it). Those of them whose heartbeat is older than
    `stale_after` are stopped or frozen: they are named; when all beat, all of them are.
    """
    if not beats or any(beat is None or not beat.armed for beat in beats.values()):
        return None
    present = [beat for beat in beats.values() if beat is not None]  # every one of them, as just checked
    behind = min(beat.position for beat in present)
    laggards = tuple(beat for beat in present if beat.position == behind)
    phase = laggards[0].phase
    seconds = now - max(beat.since for beat in laggards)
    if phase in EXEMPT_PHASES or seconds <= limit:
        return None
    frozen = tuple(beat.rank for beat in laggards if now - beat.beat > stale_after)
    named = tuple(beat for beat in laggards if beat.rank in frozen) if frozen else laggards
    return Hang(named=named, frozen=frozen, phase=phase, step=laggards[0].step, seconds=seconds)


def describe(hang: Hang, *, now: float, limit: float, step_times: list[float], reporter: int, stacks: Path) -> str:
    """The one line that names the hung rank(s), with the step time the limit was compared with."""
    shown = ", ".join(f"{beat.rank} ({beat.host}, pid {beat.pid})" for beat in hang.named[:MAX_NAMED])
    more = f" and {len(hang.named) - MAX_NAMED} more" if len(hang.named) > MAX_NAMED else ""
    who = f"rank {shown}" if len(hang.named) == 1 else f"ranks {shown}{more}"
    if step_times:
        typical = (
            f"steps took {statistics.median(step_times):.3g} s (median of the last {len(step_times)} on rank "
            f"{reporter}, slowest {max(step_times):.3g} s)"
        )
    else:
        typical = f"no step of this attempt on rank {reporter} ran without an evaluation or a save to time it"
    if hang.frozen:
        age = min(now - beat.beat for beat in hang.named)
        state = (
            f"its heartbeat stopped {age:.1f} s ago (the process is stopped or cannot run Python: kill -STOP, a hung "
            "device or filesystem, a deadlock holding the GIL)"
        )
    elif len(hang.named) == 1:
        state = "its process is alive: its stacks show where it waits"
    else:
        state = "every one of them is alive and in this phase: their stacks show which one the others wait for"
    return (
        f"{who} hung in {hang.phase} at step {hang.step} for {hang.seconds:.1f} s (dist.step_timeout {limit:g} s; "
        f"{typical}); {state}. Python stacks of the live ranks: {stacks}. Exiting with status {HUNG_EXIT_CODE}; "
        "rerun the same command to resume from the last checkpoint"
    )


def watched_phase(phase: str) -> Callable[[Method], Method]:
    """Decorate a runner method so that it runs in `phase` of the runner's hang watch (`self.hang_watch`)."""

    def decorate(method: Method) -> Method:
        @wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self.hang_watch.during(phase):
                return method(self, *args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate


class HangWatch:
    """One rank's hang watch. Inert until `start` (and for good with `limit` 0): a runner built only to evaluate or
    look at a run notes phases for nothing and writes nothing."""

    def __init__(
        self,
        run_dir: Path,
        state: RunnerState,
        *,
        rank: int,
        world_size: int,
        limit: float,
        group: str,
        dist_timeout: float = math.inf,
    ):
        self.run_dir = Path(run_dir)
        self.state = state
        self.rank, self.world_size = rank, world_size
        self.limit = float(limit)
        self.dist_timeout = float(dist_timeout)
        self.group = group  # "" or "replica-<id>-": TorchFT groups share the run directory
        # A heartbeat is rewritten within `TICK_SECONDS` of a change of phase, and every `period` s anyway (when the
        # thread also checks for a hang); a rank whose heartbeat is `stale_after` s old no longer runs Python.
        self.period = min(max(self.limit / 20, 0.2), 5.0)
        self.stale_after = max(4 * self.period, 2.0)
        self.host = socket.gethostname()
        self.attempt = ""
        self.active = False
        self.verdict: HangVerdict | None = None
        self.step_times: deque[float] = deque(maxlen=50)
        self._mark = ("setup", state.global_step, time.time())  # (phase, step, since): one assignment per change
        self._step_started, self._step_timed = 0.0, False
        self._start_step = state.global_step
        self._writer: HeartbeatWriter | None = None
        self._beat_at = 0.0
        self._on_hang: Callable[[HangVerdict], None] = lambda verdict: None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_runner(cls, runner: Any) -> HangWatch:
        """The watch of a runner whose run dir, rank and state exist (`BaseRunner.__init__`)."""
        config = runner.config
        group = f"replica-{config.lookup('ft.replica_id', 0)}-" if config.lookup("ft.enabled", False) else ""
        return cls(
            runner.run_dir.path,
            runner.state,
            rank=runner.rank,
            world_size=runner.world_size,
            limit=config.dist.step_timeout,
            group=group,
            dist_timeout=config.dist.timeout,
        )

    # ---- the loop's side: notes in memory ------------------------------------------------------------------------

    def start(self, attempt: str, on_hang: Callable[[HangVerdict], None]) -> None:
        """The attempt `attempt` (its stamp, equal on every rank) begins: start beating and watching. `on_hang` is
        called on the watch thread with the verdict before the process exits (records the attempt)."""
        if self.limit <= 0 or self.active:
            return
        self.attempt, self._on_hang = attempt, on_hang
        if self.rank == 0 and self.world_size > 1 and self.limit >= self.dist_timeout:
            logger.warning(
                "dist.step_timeout (%g s) is not below dist.timeout (%g s): a rank that hangs is ended by the "
                "collective timeout first, which names nobody; lower dist.step_timeout (docs/resilience.md)",
                self.limit,
                self.dist_timeout,
            )
        self._start_step = self.state.global_step
        self._mark = ("setup", self.state.global_step, time.time())
        try:
            self._writer = HeartbeatWriter(heartbeat_path(self.run_dir, self.group, self.rank))
        except OSError as error:  # the heartbeat only watches the training: it never stops it
            logger.warning("the hang watch of rank %d is off for this attempt: %s", self.rank, error)
            return
        self.active = True
        self._publish()
        self._thread = threading.Thread(target=self._run, name="perdure-hang-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The attempt ends: the record says closing (no other rank waits for this one), the thread ends."""
        if not self.active:
            return
        self.enter("closing")
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period + 1)
        self._publish()
        self.active = False
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def enter(self, phase: str) -> None:
        """This rank is now in `phase` (at the current global step)."""
        self._mark = (phase, self.state.global_step, time.time())

    def fetching(self, batches: Iterable[Any]) -> Iterator[Any]:
        """`batches` (an epoch of the train loader), noting data_loading while the next batch is awaited and
        training_step once it is there; the duration of each step read without an evaluation or save between is kept
        for the hang line."""
        if not self.active:
            return iter(batches)
        return self._fetching(iter(batches))

    def _fetching(self, batches: Iterator[Any]) -> Iterator[Any]:
        while True:
            step, now = self.state.global_step + 1, time.time()
            if self._mark[1] != step or self._mark[0] not in ("data_loading", "training_step"):
                self._new_step(step, now)
            self._mark = ("data_loading", step, now)
            try:
                batch = next(batches)
            except StopIteration:
                self._mark = ("end_of_step", step - 1, time.time())
                return
            self._mark = ("training_step", step, time.time())
            yield batch

    def _new_step(self, step: int, now: float) -> None:
        """Step `step` starts reading: keep the time of the one before unless an evaluation or a save was in it (or
        it was the attempt's first, which compiles and warms up)."""
        if self._step_timed and step - 1 > self._start_step + 1:
            self.step_times.append(now - self._step_started)
        self._step_started, self._step_timed = now, True

    def _armed(self) -> bool:
        """Whether this rank finished a step of this attempt: until then `dist.timeout` alone bounds it."""
        return self.state.global_step > self._start_step

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Run the block in `phase` (an evaluation, a save, closing); afterwards the rank is at end_of_step, or back
        in the exempt phase it was in."""
        previous = self._mark
        self._mark = (phase, self.state.global_step, time.time())
        self._step_timed = False
        try:
            yield
        finally:
            if previous[0] in EXEMPT_PHASES:
                self._mark = previous
            else:
                self._mark = ("end_of_step", self.state.global_step, time.time())

    def outcome(self, status: str, reason: str) -> tuple[str, str]:
        """How the attempt ended: `hung` with the verdict's line when a hang was declared in it, else as given."""
        verdict = self.verdict or (self._read_verdict() if self.active else None)
        return ("hung", verdict.line) if verdict is not None else (status, reason)

    # ---- the watch thread ----------------------------------------------------------------------------------------

    @property
    def hang_dir(self) -> Path:
        return self.run_dir / "hangs" / f"{self.attempt}{'-' + self.group.rstrip('-') if self.group else ''}"

    def _run(self) -> None:
        published, checked = self._mark, time.monotonic()
        while not self._stop.wait(TICK_SECONDS):
            mark = self._mark
            if mark is not published or time.monotonic() - self._beat_at >= self.period:
                self._publish()
                published = mark
            if time.monotonic() - checked < self.period:
                continue
            checked, now = time.monotonic(), time.time()
            if not self._armed() or now - mark[2] < self.limit / 2:
                continue
            try:
                verdict = self._read_verdict() or self._look(now)
            except OSError as error:  # the run directory: the watch reports it and keeps watching
                logger.warning("the hang watch could not read %s: %s", self.run_dir, error)
                continue
            if verdict is not None:
                self._act(verdict)
                return

    def _publish(self) -> None:
        if self._writer is None:
            return
        phase, step, since = self._mark
        beat = RankBeat(
            attempt=self.attempt,
            rank=self.rank,
            host=self.host,
            pid=os.getpid(),
            phase=phase,
            step=step,
            since=since,
            beat=time.time(),
            armed=self._armed(),
        )
        self._writer.write(beat)
        self._beat_at = time.monotonic()

    def _look(self, now: float) -> HangVerdict | None:
        """Read every rank's heartbeat; declare the hang if there is one (the first rank to publish it reports)."""
        paths = {rank: heartbeat_path(self.run_dir, self.group, rank) for rank in range(self.world_size)}
        beats = {rank: read_beat(path, self.attempt) for rank, path in paths.items()}
        hang = find_hang(beats, now=now, limit=self.limit, stale_after=self.stale_after)
        if hang is None:
            return None
        line = describe(
            hang, now=now, limit=self.limit, step_times=list(self.step_times), reporter=self.rank, stacks=self.hang_dir
        )
        verdict = HangVerdict(self.attempt, line, self.rank, tuple(b.rank for b in hang.named), hang.frozen)
        return self._declare(verdict)

    def _declare(self, verdict: HangVerdict) -> HangVerdict | None:
        """Publish `verdict` unless another rank did first (then that one holds)."""
        ensure_dir(self.hang_dir.parent)  # each level checked: a symlinked `hangs` is refused, never followed
        ensure_dir(self.hang_dir)
        target = self.hang_dir / VERDICT_NAME
        temporary = temporary_sibling(target)
        with os.fdopen(create_new(temporary), "w") as file:
            json.dump(asdict(verdict), file)
        try:
            os.link(temporary, target)  # atomic, and refused when a verdict is there: one rank reports
        except FileExistsError:
            return self._read_verdict(wait=True)
        finally:
            os.unlink(temporary)
        return verdict

    def _read_verdict(self, wait: bool = False) -> HangVerdict | None:
        path = self.hang_dir / VERDICT_NAME
        for _ in range(10 if wait else 1):
            try:
                verdict = HangVerdict.from_record(read_json(path, limit=1 << 16))
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                verdict = None
            if verdict is not None and verdict.attempt == self.attempt:
                return verdict
            time.sleep(0.1)
        return None

    def _act(self, verdict: HangVerdict) -> None:
        """Say it (the reporter), write this rank's stacks, record the attempt, exit: the main thread may be blocked
        in a collective and is not waited for. Each write gets `ACT_SECONDS` (a hung filesystem must not keep the
        process alive)."""
        self.verdict = verdict
        if verdict.reporter == self.rank:
            logger.error("%s", verdict.line)
        _bounded(self._write_stacks, ACT_SECONDS)
        _bounded(lambda: self._on_hang(verdict), ACT_SECONDS)
        for handler in logging.getLogger("perdure").handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HUNG_EXIT_CODE)

    def _write_stacks(self) -> None:
        phase, step, since = self._mark
        path = self.hang_dir / f"{self.group}rank-{self.rank}.txt"
        with os.fdopen(create_new(path), "w") as file:
            file.write(
                f"rank {self.rank} ({self.host}, pid {os.getpid()}) in {phase} at step {step} for "
                f"{time.time() - since:.1f} s\nverdict: {self.verdict.line if self.verdict else ''}\n\n"
            )
            file.flush()
            faulthandler.dump_traceback(file, all_threads=True)


def _bounded(work: Callable[[], None], seconds: float) -> None:
    """Run `work` on a thread of its own; give up waiting after `seconds` (it may be stuck on a hung filesystem)."""
    thread = threading.Thread(target=work, name="perdure-hang-report", daemon=True)
    thread.start()
    thread.join(seconds)
