"""The local dispatcher: `perdure sweep run DIR --slots N | --gpus 0,1,...` drains a sweep, one job per slot.

Each poll, under the sweep's lock, a dispatcher: records the jobs that ended (exit 0 -> done; perdure's preemption
exit 128+SIGTERM / 128+SIGUSR1 -> preempted, claimable again at once; 93, a run stuck in a crash loop -> failed,
never requeued; anything else -> failed, requeued while its failures <= --retries); notes the run dir each new job
logged; stops the jobs that `cancel` marked; requeues the running rows of dispatchers that died (never those of a live
one, see `liveness`); claims claimable rows for its free slots and starts them. Several dispatchers on several hosts
can drain one sweep at once: a row is claimed only under the lock, so no job runs twice.

SIGTERM, SIGINT or SIGUSR1 to the dispatcher: it claims nothing more, forwards the signal to its jobs (perdure
saves and exits 128+signal; a second SIGINT, forwarded too, makes perdure exit at once), waits for them (killing
those still there after `STOP_GRACE_S`), records them as preempted and exits 128+signal. Rows left preempted
are continued by the next dispatcher (or by this sweep submitted to SLURM).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from perdure.resilience.crash_loop import RETRY_ENV
from perdure.sweep.launch import JobProcess, job_environment, launch_key
from perdure.sweep.liveness import DispatcherHeartbeat, dispatcher_alive, hostname, process_alive
from perdure.sweep.matrix import SweepError
from perdure.sweep.state import CLAIMABLE, JobRow, SweepState, locked_state, log_path, read_state
from perdure.workspace.launch import LAUNCH_ENV, RESTART_ENV
from perdure.workspace.sidecar import utc_stamp

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# After forwarding a stop signal, how long jobs get to save before they are killed.
STOP_GRACE_S = 300.0
_TICK_S = 0.1
_GPU_ID = re.compile(r"^[A-Za-z0-9:_-]+$")


@dataclass(frozen=True)
class Slot:
    """Where one job runs: `name` shows in the status; `cuda` becomes its CUDA_VISIBLE_DEVICES (None: unset)."""

    name: str
    cuda: str | None = None


def make_slots(*, slots: int | None = None, gpus: str | None = None, gpus_per_job: int = 1) -> list[Slot]:
    """`slots=N`: N slots without GPUs; `gpus="0,1,2,3"`: a slot per GPU (or per `gpus_per_job` GPUs)."""
    if (slots is None) == (gpus is None):
        raise SweepError("give either --slots N (jobs without GPUs) or --gpus 0,1,... (one job per GPU)")
    if slots is not None:
        if slots < 1:
            raise SweepError(f"--slots {slots}: give at least 1")
        return [Slot(f"slot{index}") for index in range(slots)]
    ids = [token.strip() for token in str(gpus).split(",")]
    if not all(ids) or not all(_GPU_ID.match(token) for token in ids) or len(set(ids)) != len(ids):
        raise SweepError(f"--gpus {gpus!r}: give distinct GPU ids separated by commas, e.g. --gpus 0,1,2,3")
    if gpus_per_job < 1 or len(ids) % gpus_per_job:
        raise SweepError(f"--gpus-per-job {gpus_per_job}: it must divide the {len(ids)} GPUs given by --gpus")
    groups = [ids[i : i + gpus_per_job] for i in range(0, len(ids), gpus_per_job)]
    return [Slot("gpu" + ",".join(group), ",".join(group)) for group in groups]


class Dispatcher:
    """Runs the jobs of one sweep in `slots` until nothing is queued or running (see the module docstring)."""

    def __init__(
        self,
        sweep_dir: str | os.PathLike,
        slots: Sequence[Slot],
        *,
        retries: int = 0,
        poll: float = 1.0,
        forever: bool = False,
        stale_after: float = 60.0,
        say: Callable[[str], None] | None = None,
    ) -> None:
        if retries < 0:
            raise SweepError(f"--retries {retries}: give 0 or more")
        if poll <= 0:
            raise SweepError(f"--poll {poll}: give a positive number of seconds")
        self.sweep_dir = Path(sweep_dir)
        self.slots = list(slots)
        self.retries, self.poll, self.forever, self.stale_after = retries, poll, forever, stale_after
        self.say = say or (lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", flush=True))
        self.host = hostname()
        self.jobs: dict[str, tuple[JobProcess, Slot]] = {}
        self._signals: list[int] = []  # received, not yet forwarded
        self._stop_signal: int | None = None
        self._stop_deadline = 0.0
        self._cancelling: set[str] = set()
        self._forwarded: set[int] = set()  # signals sent to jobs: exiting of one of them is a preemption
        self.heartbeat: DispatcherHeartbeat | None = None

    # ---- the loop ----------------------------------------------------------------------------------------------

    def run(self) -> int:
        """Dispatch until done; returns 0 (every job done or cancelled), 1 (some failed) or 128 + stop signal."""
        read_state(self.sweep_dir)  # a missing or corrupt sweep is reported before anything starts
        self.heartbeat = DispatcherHeartbeat(self.sweep_dir)
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        self.say(f"dispatcher {self.heartbeat.id}: {len(self.slots)} slot(s) on {self.sweep_dir}")
        try:
            while True:
                self.heartbeat.beat()
                with locked_state(self.sweep_dir) as state:
                    self._record_exits(state)
                    self._record_run_dirs(state)
                    self._stop_cancelled(state)
                    if self._signals:
                        self._forward_signals()
                    if self._stop_signal is None:
                        self._requeue_orphans(state)
                        self._claim(state)
                    busy = self._work_left(state)
                    failed = state.counts()["failed"]
                if self._stop_signal is not None and not self.jobs:
                    self.say(f"stopped by {signal.Signals(self._stop_signal).name}")
                    return 128 + self._stop_signal
                if not busy and not self.jobs and not self.forever:
                    self.say(f"nothing queued or running: {failed} failed" if failed else "all jobs ended")
                    return 1 if failed else 0
                self._sleep()
        except BaseException:
            self._abandon()
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.heartbeat.remove()

    @property
    def _own_id(self) -> str:
        """This dispatcher's id, as its heartbeat names it (`run` starts the heartbeat before anything reads this)."""
        assert self.heartbeat is not None
        return self.heartbeat.id

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)
        if self._stop_signal is None:
            self._stop_signal = signum
            self._stop_deadline = time.monotonic() + STOP_GRACE_S

    def _sleep(self) -> None:
        """Up to `poll` seconds, cut short by a signal or a job's exit."""
        deadline = time.monotonic() + self.poll
        while time.monotonic() < deadline:
            if self._signals or any(job.poll() is not None for job, _ in self.jobs.values()):
                return
            time.sleep(_TICK_S)

    # ---- steps of one poll -------------------------------------------------------------------------------------

    def _record_exits(self, state: SweepState) -> None:
        killed_late = self._stop_signal is not None and time.monotonic() > self._stop_deadline
        for job_id, (job, slot) in list(self.jobs.items()):
            if killed_late and job.poll() is None:
                self.say(f"{job_id}: did not exit within {STOP_GRACE_S:.0f} s of the stop signal; killing it")
                self._forwarded.add(signal.SIGKILL)
                job.signal(signal.SIGKILL)
                job.wait()
            code = job.poll()
            if code is None:
                continue
            del self.jobs[job_id]
            row = state.job(job_id)
            row.run_dir = job.find_run_dir() or row.run_dir
            if row.dispatcher != self._own_id:  # taken from us (a hand-edited state): record nothing
                continue
            row.finish_attempt(code, retries=self.retries, forwarded=self._forwarded)
            if killed_late:
                row.note = f"killed {STOP_GRACE_S:.0f} s after the stop signal; it continues from its last checkpoint"
            self.say(f"{job_id}: {row.state} on {slot.name}: {row.note}")

    def _record_run_dirs(self, state: SweepState) -> None:
        for job_id, (job, _) in self.jobs.items():
            found = job.find_run_dir()
            if found is not None:
                state.job(job_id).run_dir = found

    def _stop_cancelled(self, state: SweepState) -> None:
        for job_id, (job, _) in self.jobs.items():
            if state.job(job_id).state == "cancelled" and job_id not in self._cancelling:
                self.say(f"{job_id}: cancelled; stopping it (SIGTERM: it saves and exits)")
                job.signal(signal.SIGTERM)
                self._cancelling.add(job_id)

    def _forward_signals(self) -> None:
        for signum in self._signals:
            self._forwarded.add(signum)
            name = signal.Signals(signum).name
            self.say(f"received {name}: forwarding it to {len(self.jobs)} job(s), starting nothing new")
            for job, _ in self.jobs.values():
                job.signal(signum)
        self._signals.clear()

    def _requeue_orphans(self, state: SweepState) -> None:
        """Requeue the running rows of dead dispatchers, once their job processes are gone too."""
        alive: dict[str, bool] = {}
        for row in state.jobs:
            if row.state != "running" or row.slurm_job is not None or row.dispatcher == self._own_id:
                continue
            owner = row.dispatcher or ""
            if owner not in alive:
                alive[owner] = bool(owner) and dispatcher_alive(self.sweep_dir, owner, self.stale_after)
            if alive[owner]:
                continue
            if row.host == self.host and process_alive(row.pid, row.pid_start):
                continue  # its dispatcher died; the job got SIGTERM and is still saving: wait for it
            row.requeue(f"requeued at {utc_stamp()}: dispatcher {owner or '?'} on {row.host or '?'} died")
            self.say(f"{row.id}: {row.note}")

    def _claim(self, state: SweepState) -> None:
        free = [slot for slot in self.slots if slot not in {used for _, used in self.jobs.values()}]
        if not free:
            return
        # preempted jobs first: they have work in flight
        waiting = [row for row in state.jobs if row.state in CLAIMABLE and row.slurm_job is None]
        waiting.sort(key=lambda row: row.state != "preempted")
        for row, slot in zip(waiting, free):
            self._start(state, row, slot)

    def _start(self, state: SweepState, row: JobRow, slot: Slot) -> None:
        row.start_attempt(host=self.host, slot=slot.name, dispatcher=self._own_id)
        extra = {"PERDURE_SWEEP_DIR": str(self.sweep_dir.resolve()), "PERDURE_SWEEP_JOB": row.id}
        if row.retry:  # the first launch after `perdure sweep retry`: a run stuck in a crash loop tries again
            extra[RETRY_ENV], row.retry = "1", None
        # One launch per job: a requeue or retry continues the run its first attempt started, even after a commit.
        extra[LAUNCH_ENV] = f"{launch_key(self.sweep_dir)}:{row.id}"
        extra[RESTART_ENV] = str(row.attempts - 1)
        if slot.cuda is not None:
            extra["CUDA_VISIBLE_DEVICES"] = slot.cuda
        argv = state.argv(row)
        header = f"{utc_stamp()} attempt {row.attempts} of {row.id} on {self.host}:{slot.name}: {_quote(argv)}"
        job = JobProcess(
            argv,
            env=job_environment(os.environ, state.env, **extra),
            cwd=state.workdir,
            log=log_path(self.sweep_dir, row.id),
            header=header,
        )
        job.start()
        row.pid, row.pid_start = job.pid, job.pid_start
        self.jobs[row.id] = (job, slot)
        self.say(f"{row.id}: started attempt {row.attempts} on {slot.name} (pid {job.pid})")

    def _work_left(self, state: SweepState) -> bool:
        """Anything queued, or running locally anywhere (another dispatcher's job might need requeueing)."""
        return any(row.slurm_job is None and (row.state in CLAIMABLE or row.state == "running") for row in state.jobs)

    def _abandon(self) -> None:
        """The dispatcher itself failed: stop its jobs so that none runs on unowned (they save and exit); the
        rows stay `running` under a dispatcher that is gone, so the next dispatcher requeues them."""
        for job, _ in self.jobs.values():
            job.signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for job, _ in self.jobs.values():
            while job.poll() is None and time.monotonic() < deadline:
                time.sleep(_TICK_S)
            job.signal(signal.SIGKILL)


def _quote(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(arg) for arg in argv)
