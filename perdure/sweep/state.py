"""The sweep's state: `DIR/sweep.json` (the command, the environment and one row per job), changed only under the
flock of `DIR/lock`.

Every change is read-modify-write inside `locked_state(DIR)`: take the flock, read the file, change rows, replace the
file atomically (temporary file, fsync, rename, fsync of DIR), drop the flock. The flock is what makes two
dispatchers on two hosts never claim one job: both read and write under it. flock works across hosts on NFS (Linux
emulates it with byte-range locks) and on Lustre mounted with `-o flock`; a filesystem that refuses it gets a clear
error. Readers that only look (`perdure sweep status`) read without the lock: the rename means they see the old file
or the new one, never a mix.

The file may come from anyone: it is read only if it is a regular file (never through a symlink, never a FIFO),
at most `MAX_STATE_BYTES`, and every field is type-checked; anything else is a `SweepError` that says what is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import stat
import time
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from perdure.atomic import atomic_write_text
from perdure.resilience.crash_loop import STUCK_EXIT
from perdure.sweep.matrix import JOB_ID_PATTERN, Matrix, Scalar, SweepError
from perdure.workspace.sidecar import utc_stamp

STATE_NAME = "sweep.json"
LOCK_NAME = "lock"
LOGS_DIR = "logs"
STATE_FORMAT = "perdure-sweep/1"
MAX_STATE_BYTES = 64 << 20
LOCK_TIMEOUT_S = 60.0
JOB_STATES = ("queued", "running", "done", "failed", "preempted", "cancelled")
# A job that exits with one of these was preempted: perdure saved and exited 128 + SIGTERM / SIGUSR1 (or the
# program died of that signal without a handler). It is requeued at once; its rerun continues the same run dir.
PREEMPTED_EXITS = {128 + signal.SIGTERM, 128 + signal.SIGUSR1, -signal.SIGTERM, -signal.SIGUSR1}
CLAIMABLE = ("queued", "preempted")
FINAL = ("done", "failed", "cancelled")


@dataclass
class JobRow:
    """One job of the sweep and what happened to it. `attempts` counts claims (starts); `failures` counts failed
    exits since the last `retry`. `pid` / `pid_start` are the job's process (its start time in clock ticks guards
    against a reused pid); `dispatcher` the id of the local dispatcher running it; `slurm_job` `ARRAYID_INDEX`."""

    id: str
    overrides: dict[str, Scalar]
    state: str = "queued"
    attempts: int = 0
    failures: int = 0
    host: str | None = None
    slot: str | None = None
    pid: int | None = None
    pid_start: int | None = None
    dispatcher: str | None = None
    slurm_job: str | None = None
    started: str | None = None
    ended: str | None = None
    exit_code: int | None = None
    run_dir: str | None = None
    note: str | None = None
    retry: bool | None = None  # queued again by `perdure sweep retry`: its next launch is a retry (`PERDURE_RETRY`)

    def start_attempt(
        self, *, host: str, slot: str, dispatcher: str | None = None, slurm_job: str | None = None
    ) -> None:
        """Claimed: running on `host` / `slot`, one more attempt."""
        self.state, self.attempts = "running", self.attempts + 1
        self.host, self.slot, self.dispatcher = host, slot, dispatcher
        if slurm_job is not None:
            self.slurm_job = slurm_job
        self.started, self.ended, self.exit_code, self.pid, self.pid_start = utc_stamp(), None, None, None, None
        self.note = f"attempt {self.attempts} started"

    def finish_attempt(self, exit_code: int, *, retries: int = 0, forwarded: Collection[int] = ()) -> None:
        """The job exited: done (0), preempted (perdure's preemption exit; claimable again at once), or failed,
        requeued while `failures <= retries`. A row cancelled meanwhile stays cancelled. `forwarded`: signals the
        launcher sent to stop the job; dying of one, or exiting 128 + it, also counts as preempted."""
        self.exit_code, self.ended, self.pid, self.pid_start = exit_code, utc_stamp(), None, None
        self.dispatcher = None
        how = describe_exit(exit_code)
        if self.state == "cancelled":
            self.note = f"cancelled; {how}"
        elif exit_code == 0:
            self.state, self.note = "done", how
        elif exit_code in PREEMPTED_EXITS or any(exit_code in (128 + sig, -sig) for sig in forwarded):
            self.state, self.note = "preempted", f"{how}, requeued"
        elif exit_code == STUCK_EXIT:  # perdure: the run is stuck in a crash loop; never requeued, whatever --retries
            self.failures += 1
            self.state, self.note = "failed", f"{how}: run stuck (attempts without progress), not requeued"
        else:
            self.failures += 1
            if self.failures <= retries:
                self.state, self.note = "queued", f"{how}, retry {self.failures} of {retries}"
            else:
                self.state, self.note = "failed", how + (f", failed {self.failures} times" if retries else "")

    def requeue(self, note: str) -> None:
        """Back to the queue (a dead dispatcher's job, or `retry`): the rerun continues the same run dir."""
        self.state, self.note, self.dispatcher, self.pid, self.pid_start = "queued", note, None, None, None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe_exit(code: int) -> str:
    """`exit 2`, `exit 143 (SIGTERM)`, `killed by SIGKILL`."""
    if code < 0:
        return f"killed by {_signal_name(-code)}"
    if code > 128 and _signal_name(code - 128) != str(code - 128):
        return f"exit {code} ({_signal_name(code - 128)})"
    return f"exit {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


@dataclass
class SweepState:
    """`sweep.json`: the command every job starts with, the environment added to it, where jobs run, the rows."""

    command: list[str]
    workdir: str
    env: dict[str, str] = field(default_factory=dict)
    jobs: list[JobRow] = field(default_factory=list)
    created: str = field(default_factory=utc_stamp)
    updated: str = field(default_factory=utc_stamp)

    def job(self, job_id: str) -> JobRow:
        for row in self.jobs:
            if row.id == job_id:
                return row
        known = ", ".join(row.id for row in self.jobs[:8]) + (", ..." if len(self.jobs) > 8 else "")
        raise SweepError(f"no job '{job_id}' in this sweep; its jobs are: {known or 'none'}")

    def argv(self, row: JobRow) -> list[str]:
        """The job's command line: the sweep's command, then `--key value` per override."""
        from perdure.sweep.matrix import MatrixJob

        return MatrixJob(row.id, row.overrides).argv(self.command)

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(JOB_STATES, 0)
        for row in self.jobs:
            counts[row.state] += 1
        return counts

    def to_json(self) -> str:
        data = {
            "format": STATE_FORMAT,
            "command": self.command,
            "workdir": self.workdir,
            "env": self.env,
            "created": self.created,
            "updated": self.updated,
            "jobs": [row.to_dict() for row in self.jobs],
        }
        return json.dumps(data, indent=1, allow_nan=False) + "\n"


# ---------------------------------------------------------------------- reading and writing


def read_state(sweep_dir: str | os.PathLike) -> SweepState:
    """Read and check `DIR/sweep.json` (without the lock: fine for looking, not for changing)."""
    path = Path(sweep_dir) / STATE_NAME
    if not os.path.lexists(path):
        raise SweepError(f"{sweep_dir} is not a sweep (no {STATE_NAME}): create it with `perdure sweep init`")
    return parse_state(read_regular_file(path, MAX_STATE_BYTES), path)


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file (not a symlink, FIFO, device...) of at most `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise SweepError(f"{path} is a symlink: perdure does not follow links in a sweep dir") from None
        raise SweepError(f"{path} cannot be read: {error.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SweepError(f"{path} is not a regular file: remove it, or point perdure at the right sweep dir")
        if info.st_size > limit:
            raise SweepError(f"{path} is {info.st_size} bytes, more than the {limit} allowed: it is not a sweep file")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise SweepError(f"{path} grew past {limit} bytes while being read")
    return data


def parse_state(raw: bytes, path: Path) -> SweepState:
    def bad(reason: str) -> SweepError:
        return SweepError(f"sweep state {path} is not valid: {reason}; restore it or re-create the sweep with init")

    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise bad(f"not JSON ({type(error).__name__}: {str(error)[:200]})") from None
    if not isinstance(data, dict) or data.get("format") != STATE_FORMAT:
        raise bad(f"'format' is not {STATE_FORMAT!r}")
    command = data.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(item, str) for item in command):
        raise bad("'command' is not a list of strings")
    env = data.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise bad("'env' is not a mapping of strings")
    for key in ("workdir", "created", "updated"):
        if not isinstance(data.get(key), str):
            raise bad(f"'{key}' is not a string")
    if not isinstance(data.get("jobs"), list):
        raise bad("'jobs' is not a list")
    rows, seen = [], set()
    for index, item in enumerate(data["jobs"]):
        row = _parse_row(item, lambda reason, i=index: bad(f"jobs[{i}]: {reason}"))
        if row.id in seen:
            raise bad(f"jobs[{index}]: job id '{row.id}' appears twice")
        seen.add(row.id)
        rows.append(row)
    return SweepState(command, data["workdir"], env, rows, data["created"], data["updated"])


_ROW_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "overrides": (dict,),
    "state": (str,),
    "attempts": (int,),
    "failures": (int,),
    "host": (str, type(None)),
    "slot": (str, type(None)),
    "pid": (int, type(None)),
    "pid_start": (int, type(None)),
    "dispatcher": (str, type(None)),
    "slurm_job": (str, type(None)),
    "started": (str, type(None)),
    "ended": (str, type(None)),
    "exit_code": (int, type(None)),
    "run_dir": (str, type(None)),
    "note": (str, type(None)),
    "retry": (bool, type(None)),
}
assert set(_ROW_TYPES) == {f.name for f in fields(JobRow)}


def _parse_row(item: Any, bad: Any) -> JobRow:
    if not isinstance(item, dict):
        raise bad("not an object")
    values: dict[str, Any] = {}  # each checked against its `_ROW_TYPES` below
    for key, kinds in _ROW_TYPES.items():
        value = item.get(key)
        if key in ("id", "overrides", "state", "attempts", "failures") and key not in item:
            raise bad(f"'{key}' is missing")
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise bad(f"'{key}' = {str(value)[:80]!r} has the wrong type")
        values[key] = value
    if not JOB_ID_PATTERN.match(values["id"]):
        raise bad(f"job id {values['id'][:80]!r} is not a valid id")
    if values["state"] not in JOB_STATES:
        raise bad(f"state {values['state'][:40]!r} is not one of {', '.join(JOB_STATES)}")
    for key, value in values["overrides"].items():
        if isinstance(value, (dict, list)):
            raise bad(f"override '{key[:80]}' is not a scalar")
    return JobRow(**values)


def write_state(sweep_dir: Path, state: SweepState) -> None:
    """Replace `DIR/sweep.json` atomically and durably. Call it only while holding the lock."""
    path = Path(sweep_dir) / STATE_NAME
    if path.is_symlink() or (os.path.lexists(path) and not path.is_file()):
        raise SweepError(f"{path} is not a regular file: perdure will not write through it")
    state.updated = utc_stamp()
    atomic_write_text(path, state.to_json())


# ---------------------------------------------------------------------- the lock


class SweepLock:
    """The exclusive flock of `DIR/lock`, waited for up to `timeout` seconds. Its descriptor is close-on-exec, so
    jobs started while it is held never inherit it."""

    def __init__(self, sweep_dir: str | os.PathLike, timeout: float = LOCK_TIMEOUT_S) -> None:
        self.path = Path(sweep_dir) / LOCK_NAME
        self.timeout = timeout
        self._fd: int | None = None

    def __enter__(self) -> SweepLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise SweepError(f"cannot open the sweep lock {self.path}: {error.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SweepError(f"{self.path} is not a regular file: remove it so the sweep lock can be made")
            deadline = time.monotonic() + self.timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as error:
                    if error.errno in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                        raise SweepError(
                            f"the filesystem of {self.path} does not support flock ({error.strerror}); on Lustre "
                            "mount with -o flock, or put the sweep dir on a filesystem that supports it"
                        ) from None
                    if error.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                        raise SweepError(
                            f"the sweep lock {self.path} has been held for over {self.timeout:.0f} s: a perdure "
                            "command holding it is stuck (it is only held for a moment); find it with `fuser "
                            f"{self.path}`"
                        ) from None
                    time.sleep(0.02)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


@contextlib.contextmanager
def locked_state(sweep_dir: str | os.PathLike) -> Iterator[SweepState]:
    """Hold the sweep's lock, yield its state, write it back (if it changed) before the lock is dropped."""
    sweep_dir = Path(sweep_dir)
    with SweepLock(sweep_dir):
        state = read_state(sweep_dir)
        before = state.to_json()
        yield state
        if state.to_json() != before:
            write_state(sweep_dir, state)


def init_sweep(sweep_dir: str | os.PathLike, matrix: Matrix, *, default_workdir: Path) -> tuple[int, int]:
    """Create the sweep (or extend it): add the matrix's jobs that are new, keep every existing row.

    Returns (added, kept). The command of an existing sweep cannot change (its job ids would no longer say what
    ran); the environment is replaced by the matrix's (it applies to jobs started from now on).
    """
    sweep_dir = Path(sweep_dir)
    if os.path.lexists(sweep_dir) and not sweep_dir.is_dir():
        raise SweepError(f"sweep dir {sweep_dir} exists and is not a directory: choose another path")
    (sweep_dir / LOGS_DIR).mkdir(parents=True, exist_ok=True)
    with SweepLock(sweep_dir):
        path = sweep_dir / STATE_NAME
        if os.path.lexists(path):
            state = read_state(sweep_dir)
            if state.command != matrix.command:
                raise SweepError(
                    f"the matrix's command {matrix.command} differs from this sweep's {state.command}: a sweep runs "
                    "one command (job ids name overrides only); start a new sweep dir for the new command"
                )
        else:
            workdir = matrix.workdir or default_workdir
            state = SweepState(command=matrix.command, workdir=str(Path(workdir).resolve()))
        if matrix.workdir is not None:
            state.workdir = str(matrix.workdir.resolve())
        state.env = dict(matrix.env)
        known = {row.id for row in state.jobs}
        new = [JobRow(job.id, dict(job.overrides)) for job in matrix.jobs if job.id not in known]
        state.jobs += new
        write_state(sweep_dir, state)
    return len(new), len(known)


def log_path(sweep_dir: str | os.PathLike, job_id: str) -> Path:
    """`DIR/logs/<job>.log`: every attempt of the job appends its output there."""
    return Path(sweep_dir) / LOGS_DIR / f"{job_id}.log"
