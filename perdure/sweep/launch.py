"""Start one job and read what it reports: its exit status, and the run directory perdure logged.

A job runs in its own session (so a Ctrl-C at the dispatcher's terminal does not reach it: the dispatcher decides
what to forward), with stdout and stderr appended to `DIR/logs/<job>.log`, and dies with the process that started
it: Linux sends it SIGTERM when its parent dies (PR_SET_PDEATHSIG), which a perdure program answers by saving a
checkpoint and exiting 143. So a dispatcher killed with SIGKILL leaves no orphan holding a run's lock, and the
dispatcher that requeues its jobs finds them continuable.

The run directory is taken from the log line every perdure program writes when it starts training
(`training <run dir> from step N ...`, or `run <run dir> already ...` for a run that has nothing left to do);
a relative path is resolved against the job's working directory. A program that writes no such line (not a perdure
program) simply has no run dir in the sweep's status.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import signal
import stat
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from perdure.sweep.liveness import process_start_time
from perdure.sweep.matrix import SweepError

RUN_DIR_PATTERNS = (
    re.compile(r"\btraining (?P<path>.+?) from step \d+ \(epoch \d+\) for "),
    re.compile(r"\brun (?P<path>.+?) already (?:stopped early|reached its budget)"),
    re.compile(r"; run dir (?P<path>.+)$"),
)
_SCAN_CHUNK = 1 << 20
_PR_SET_PDEATHSIG = 1
CANNOT_START = 127


def open_log(path: Path) -> int:
    """Open `path` for appending: never through a symlink, only a regular file. Returns the descriptor."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.parent.is_symlink():
        raise SweepError(f"{path.parent} is a symlink: perdure does not write through links in a sweep dir")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as error:
        raise SweepError(f"cannot open the job log {path}: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SweepError(f"job log {path} is not a regular file: remove it")
    return fd


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM me when my parent dies (and at once if it already has)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


class JobProcess:
    """One attempt of one job, started by `start()`; `poll()` for its exit status, `signal()` to forward one."""

    def __init__(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: str | os.PathLike, log: Path, header: str
    ) -> None:
        self.argv, self.env, self.cwd, self.log, self.header = list(argv), dict(env), Path(cwd), Path(log), header
        self.process: subprocess.Popen | None = None
        self.pid: int | None = None
        self.pid_start: int | None = None
        self.returncode: int | None = None
        self.run_dir: str | None = None
        self._scan_offset = 0
        self._carry = b""

    def start(self) -> None:
        """Append the header to the log, then start the program with its output going to the log. A program that
        cannot be started (missing, not executable) ends at once with status 127 and the reason in the log."""
        fd = open_log(self.log)
        try:
            gap = "\n" if os.fstat(fd).st_size else ""
            os.write(fd, f"{gap}==> {self.header}\n".encode(errors="replace"))
            self._scan_offset = os.fstat(fd).st_size
            parent = os.getpid()
            try:
                self.process = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=fd,
                    stderr=subprocess.STDOUT,
                    cwd=self.cwd,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=lambda: _die_with_parent(parent),
                )
            except OSError as error:
                os.write(fd, f"perdure sweep: cannot start {self.argv[0]!r}: {error}\n".encode(errors="replace"))
                self.returncode = CANNOT_START
                return
        finally:
            os.close(fd)
        self.pid = self.process.pid
        self.pid_start = process_start_time(self.pid)

    def poll(self) -> int | None:
        """The exit status (negative: killed by that signal) once the program ended, else None."""
        if self.returncode is None and self.process is not None:
            self.returncode = self.process.poll()
        return self.returncode

    def wait(self) -> int:
        """Wait for the exit (a signal handler may interrupt and forward meanwhile)."""
        if self.returncode is None and self.process is not None:
            self.returncode = self.process.wait()
        return self.returncode if self.returncode is not None else CANNOT_START

    def signal(self, signum: int) -> None:
        """Send `signum` to the job's process group (its wrapper scripts and launcher workers too)."""
        if self.pid is None or self.poll() is not None:
            return
        try:
            os.killpg(self.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def find_run_dir(self) -> str | None:
        """Scan what the job logged since it started for the run dir line; returns it once found (cached)."""
        if self.run_dir is not None:
            return self.run_dir
        try:
            with open(self.log, "rb") as file:
                file.seek(self._scan_offset)
                chunk = file.read(_SCAN_CHUNK)
        except OSError:
            return None
        self._scan_offset += len(chunk)
        lines = (self._carry + chunk).split(b"\n")
        self._carry = lines.pop()[-4096:]  # an unfinished line, kept for the next scan
        for line in lines:
            found = run_dir_in_line(line.decode("utf-8", "replace"))
            if found is not None:
                path = self.cwd / found
                if path.is_dir():
                    self.run_dir = str(path.resolve())
                    return self.run_dir
        return None


def run_dir_in_line(line: str) -> str | None:
    """The run dir a perdure log line names, if it is one of the lines that do."""
    for pattern in RUN_DIR_PATTERNS:
        match = pattern.search(line.rstrip("\r"))
        if match:
            return match.group("path")
    return None


def job_environment(base: Mapping[str, str], extra: Mapping[str, str], **sweep: str) -> dict[str, str]:
    """The job's environment: the launcher's, the matrix's `env`, then what the sweep sets (job id, GPUs...)."""
    env = dict(base)
    env.update(extra)
    env.update(sweep)
    return env


def launch_key(sweep_dir: Path) -> str:
    """The sweep's part of its jobs' launch ids: a short hash of the sweep directory's absolute path."""
    return "sweep-" + hashlib.sha256(str(Path(sweep_dir).resolve()).encode()).hexdigest()[:12]
