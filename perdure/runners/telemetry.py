"""RunTelemetry: everything a run reports about itself, from the main process.

Console lines (and a progress bar on a terminal), the run's log file, metrics.csv, TensorBoard, W&B, media, the
metadata of each attempt, and `sidecar.json` with its heartbeat, which the run registry reads. Other ranks get an
inert instance, so the runner calls it unconditionally.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from perdure.config import RunnerConfig
from perdure.loggers.base import LoggerGroup, MetricLogger
from perdure.loggers.console import set_progress_bar
from perdure.loggers.progress import ProgressBar
from perdure.runners.goodput import GoodputClock
from perdure.runners.state import RunnerState
from perdure.runners.throughput import format_metric
from perdure.workspace.goodput import is_goodput
from perdure.workspace.heartbeat import Heartbeat
from perdure.workspace.identity import canonical_config
from perdure.workspace.metadata import write_metadata
from perdure.workspace.run_dir import RunDir
from perdure.workspace.sidecar import Sidecar, utc_stamp

RESTART_COUNTERS = ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
INTERRUPTIONS = ("interrupted", "preempted", "failed", "hung")  # how an attempt ends that counts towards the MTBF
HEARTBEAT_SECONDS = 10.0

logger = logging.getLogger("perdure")


class RunTelemetry:
    """Created by the runner once the run dir exists and is locked; `start` after the restore, `finish` at the end."""

    def __init__(
        self, run_dir: RunDir, config: RunnerConfig, state: RunnerState, loggers: list[MetricLogger], *, active: bool
    ) -> None:
        self.run_dir = run_dir
        self.config = config
        self.state = state
        self.active = active
        self.loggers = LoggerGroup(loggers if active else [])
        self.sidecar: Sidecar | None = None
        self.progress: ProgressBar | None = None
        self.heartbeat: Heartbeat | None = None
        self._heartbeat_at = self._sidecar_at = time.monotonic()
        self._sidecar_failed = False
        self._durability = BackgroundDurability(self._make_durable)
        self.goodput = GoodputClock(state.global_step)  # where the attempt's time goes, from the process's start

    def start(self, *, attempt: str, resumed_from: str | None, details: Mapping[str, Any] | None = None) -> None:
        """Record the attempt (metadata, sidecar entry, restart counters, `details` such as the code it runs) and open
        the metric loggers.

        Called when training begins, after the restore, before the first step or checkpoint: loggers drop what an
        earlier attempt logged past the resumed step, and W&B puts its run id into the state the next checkpoint
        carries.
        """
        if not self.active:
            return
        self._record_attempt(attempt, resumed_from, details or {})
        self.loggers.open(self.run_dir.path, resumed_step=self.state.global_step, state=self.state, config=self.config)
        self.heartbeat = Heartbeat(self.run_dir.path, self.state.global_step)
        self._attempt_sidecar().record(step=self.state.global_step, epoch=self.state.epoch)
        self.goodput.resumed_at(self.state.global_step)
        self._record_goodput()
        self._attempt_sidecar().write()

    def record_failed_setup(
        self, *, attempt: str, reason: str, details: Mapping[str, Any] | None = None, source: Any = None
    ) -> None:
        """A setup failed before training: an attempt that starts and fails at once, with `reason`. No loggers.
        `source` (the `CheckpointInfo` the attempt was to resume from) is recorded as where it started, restored or
        not, so that a setup failing every time counts as attempts without progress (`resilience/crash_loop.py`)."""
        if not self.active:
            return
        step = (source.global_step or 0) if source is not None else self.state.global_step
        self._record_attempt(attempt, str(source.path) if source is not None else None, details or {}, step)
        self.goodput.resumed_at(step)
        self._record_goodput()
        self._attempt_sidecar().finish_attempt("failed", reason)
        self._attempt_sidecar().write()
        self.active = False

    def _sidecar_of_this_run(self) -> Sidecar:
        """The run's sidecar as on disk (or a new one), named by this run's identity, config and tags."""
        return self._new_sidecar(
            run_id=self.run_dir.run_id,
            lineage=self.run_dir.lineage,
            code_id=self.run_dir.code_id,
            config_id=self.run_dir.config_id,
            hparams=canonical_config(self.config),
            tags=list(self.config.workspace.tags),
        )

    def _record_attempt(
        self, attempt: str, resumed_from: str | None, details: Mapping[str, Any], resumed_step: int | None = None
    ) -> None:
        write_metadata(self.run_dir.path, self.config, attempt)
        self.sidecar = self._sidecar_of_this_run()
        previous = self.sidecar.current_attempt
        ran = previous.get("code_id") if previous is not None else None
        if ran and details.get("code_id") and ran != details["code_id"] and self.run_dir.unfinished is None:
            logger.warning(
                "the code changed between attempts of run %s: the previous attempt ran %s, this one runs %s (each "
                "attempt's code and diff are in metadata/attempts/)",
                self.run_dir.path,
                ran,
                details["code_id"],
            )
        restarts = {name: _int_or_none(os.environ.get(name)) for name in RESTART_COUNTERS if name in os.environ}
        unit = self.config.training_mode()
        details = {**details, "budget": {unit: self.config.lookup(unit)}}  # `perdure runs show` prints it
        entry = self.sidecar.start_attempt(
            started=attempt,
            restart_counts=restarts,
            resumed_from=str(Path(resumed_from).resolve()) if resumed_from else None,
            resumed_step=self.state.global_step if resumed_step is None else resumed_step,
            details=details,
        )
        if entry.get("steps_lost"):
            logger.info("the interruption cost %d steps (trained, not checkpointed)", entry["steps_lost"])

    def _attempt_sidecar(self) -> Sidecar:
        """The sidecar the attempt's record made (`_record_attempt`), for what is written after it."""
        assert self.sidecar is not None  # `_record_attempt` made it
        return self.sidecar

    def _new_sidecar(self, **identity: Any) -> Sidecar:
        """The run's sidecar, loading the existing one (a TorchFT replica group's shares it with the other groups)."""
        return Sidecar(self.run_dir.path, **identity)

    def begin_training(self, total: int | None) -> None:
        """The loop starts: show a progress bar on a terminal (rate and ETA measured from here)."""
        self.goodput.loop_started(self.state.global_step)
        if not self.active:
            return
        self.progress = ProgressBar(total, initial=self.state.global_step, mode=self.config.log.progress)
        if self.progress.enabled:
            set_progress_bar(self.progress)

    def step(self, step: int) -> None:
        """After every optimizer step: the goodput clock, the progress bar and the heartbeat's step (whose mtime also
        says the run is alive, however far apart its log lines are)."""
        self.goodput.stepped(step)
        if self.progress is not None:
            self.progress.update(step)
        if self.heartbeat is not None:  # a store into a mapped page (or a pwrite): a SIGKILL leaves the exact step
            self.heartbeat.beat(step)
        self.alive()

    def alive(self) -> None:
        """After every step and every evaluation batch: the heartbeat, every few seconds, so that a run in a long
        evaluation (or whose log lines are far apart) is not shown as stale."""
        now = time.monotonic()
        if self.heartbeat is not None and now - self._heartbeat_at > HEARTBEAT_SECONDS:
            self.heartbeat.touch(self.state.global_step)
            self._heartbeat_at = now

    def run_mtbf(self) -> float | None:
        """Rank 0: the run's mean time between interruptions so far, in seconds: the wall time of its attempts (this
        one's so far) over the attempts that ended interrupted (killed), preempted, failed or hung, at least one.
        None on the other ranks."""
        if self.sidecar is None:
            return None
        earlier = self.sidecar.to_dict()["attempts"][:-1]
        walls = [sum(a["goodput"]["seconds"].values()) for a in earlier if is_goodput(a.get("goodput"))]
        interruptions = sum(1 for a in earlier if a.get("status") in INTERRUPTIONS)
        return (sum(walls) + self.goodput.elapsed()) / max(interruptions, 1)

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        """One line on the console and in the log file, a row per metric, the sidecar's summary."""
        if not self.active:
            return
        if self.progress is not None and split == "train":
            self.progress.update(step, {name: value for name, value in metrics.items() if name == "loss"})
        budget = self.config.steps if self.config.training_mode() == "steps" else None
        where = f"step {step}/{budget}" if budget else f"step {step} epoch {self.state.epoch}"
        logger.info("%s %s: %s", where, split, " ".join(format_metric(name, value) for name, value in metrics.items()))
        self.loggers.log_metrics(split, metrics, step)
        if self.sidecar is not None:
            self.sidecar.record(step=step, epoch=self.state.epoch, metrics={split: metrics})

    def log_image(self, tag: str, image: Any, step: int) -> None:
        if self.active:
            self.loggers.log_image(tag, image, step)

    def flush(self) -> None:
        """At every log interval: loggers flushed; every few seconds also the sidecar replaced (not fsynced) and the
        heartbeat touched, so that fast runs do not spend their time rewriting a summary."""
        if not self.active:
            return
        self.loggers.flush()
        if self.heartbeat is not None:
            self.heartbeat.beat(self.state.global_step)
        now = time.monotonic()
        if self.sidecar is not None and now - self._sidecar_at > HEARTBEAT_SECONDS:
            self.sidecar.record(step=self.state.global_step, epoch=self.state.epoch)
            self._write_sidecar(durable=False)
            self._sidecar_at = self._heartbeat_at = now

    def before_checkpoint(self) -> None:
        """A checkpoint of this step is about to be written: what was logged up to it (the evaluation of this very
        step included) is handed to the OS first, so a kill right after the commit loses no row the checkpoint covers
        (the resumed run does not log those steps again). No fsync here, which would stall the loop: `checkpoint`
        makes them durable once the checkpoint is committed."""
        if self.active:
            self.loggers.flush()

    def checkpoint(self, name: str, *, seconds: float, best: str | None, background: bool = False) -> None:
        """A checkpoint was committed: loggers made durable up to it, the sidecar names it. `background` (an async
        save, reported by the training loop): the fsyncs run on a thread of their own, since on a filesystem busy
        writing the next checkpoint an fsync can take seconds, and the loop need not wait for a summary's."""
        self.goodput.committed(name, self.state.global_step)
        if not self.active:
            return
        self.loggers.flush(durable=not background)
        if self.sidecar is not None:
            self.sidecar.record(latest_checkpoint=name, best_checkpoint=best, save_seconds=seconds)
        if background:
            self._durability.request()
        elif self.sidecar is not None:
            self._write_sidecar()

    def _make_durable(self) -> None:
        """On the durability thread: what `checkpoint(background=True)` flushed, fsynced, and the sidecar replaced."""
        self.loggers.sync()
        if self.sidecar is not None:
            self._write_sidecar()

    def save_failed(self, name: str, error: str) -> None:
        """A save failed: the attempt's record says so at once (the run's status tells it at the end)."""
        if self.active and self.sidecar is not None:
            self.sidecar.record_save_failure(name, error)
            self._write_sidecar()

    def finish(self, status: str, reason: str) -> None:
        """The attempt ends (completed, failed, preempted, stopped): close everything, record why."""
        if not self.active:
            return
        if self.progress is not None:
            self.progress.close()
            set_progress_bar(None)
            self.progress = None
        self._durability.wait()
        try:
            self.loggers.close()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.touch(self.state.global_step)
                self.heartbeat.close()
            if self.sidecar is not None:
                self.sidecar.record(step=self.state.global_step, epoch=self.state.epoch)
                self._record_goodput()
                self.sidecar.finish_attempt(status, reason)
                self._write_sidecar()
            self.active = False

    def record_hang(self, reason: str, status: str = "hung") -> None:
        """The hang watch ends the attempt (`perdure.resilience.hang_watch`; called on its thread, the process exits
        right after): the sidecar records `hung` with `reason`, then the loggers are flushed (not closed). The kill
        watch of a replica group (`perdure.ft.kill_watch`) records `killed` the same way."""
        if not self.active or self.sidecar is None:
            return
        self.active = False
        self.sidecar.record(step=self.state.global_step, epoch=self.state.epoch)
        self._record_goodput()
        self.sidecar.finish_attempt(status, reason)
        self._write_sidecar()
        self.loggers.flush()

    def record_hang_for(self, attempt: str, reason: str) -> None:
        """Another rank records the hang of attempt `attempt` because rank 0, which keeps the sidecar, is the stopped
        one: the sidecar on disk ends that attempt `hung` (left alone if it recorded another end meanwhile)."""
        sidecar = self._sidecar_of_this_run()
        current = sidecar.current_attempt
        if current is not None and current.get("started") == attempt and current.get("status") == "running":
            sidecar.finish_attempt("hung", reason)
            sidecar.write()

    def abandon(self) -> None:
        """The attempt could not begin (its first writes failed): close what `start` opened, write nothing more."""
        if not self.active:
            return
        self._durability.wait()
        try:
            self.loggers.close()
        finally:
            if self.heartbeat is not None:
                self.heartbeat.close()
            self.active = False

    def _record_goodput(self) -> None:
        """The goodput clock's record, taken now, into the attempt's sidecar entry."""
        self._attempt_sidecar().record_goodput(self.goodput.record(), utc_stamp(self.goodput.process_started))

    def _write_sidecar(self, durable: bool = True) -> None:
        """Replace sidecar.json; a failure to (a full disk) is a warning, once: the run's record is a summary, and
        losing it must never stop the training it describes."""
        self._record_goodput()
        try:
            self._attempt_sidecar().write(durable=durable)
        except OSError as error:
            if not self._sidecar_failed:
                cause = f"[Errno {error.errno}] {error.strerror}" if error.strerror else error  # the path is said once
                logger.warning("could not write %s (%s); training goes on", self._attempt_sidecar().path, cause)
            self._sidecar_failed = True
        else:
            self._sidecar_failed = False


class BackgroundDurability:
    """Runs `work` (fsyncs) on a thread of its own whenever asked; asks while it runs coalesce into one more run."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work = work
        self._condition = threading.Condition()
        self._requested = self._busy = False
        self._thread: threading.Thread | None = None

    def request(self) -> None:
        with self._condition:
            self._requested = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="perdure-durability", daemon=True)
                self._thread.start()
            self._condition.notify_all()

    def wait(self) -> None:
        """Block until the work asked for so far is done."""
        with self._condition:
            while self._requested or self._busy:
                self._condition.wait()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._requested:
                    self._condition.wait()
                self._requested, self._busy = False, True
            try:
                self._work()
            except Exception as error:  # a summary's durability: never the end of the run it describes
                logger.warning("making the run's records durable failed (%s); training goes on", error)
            finally:
                with self._condition:
                    self._busy = False
                    self._condition.notify_all()


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
