"""The run lock: two live processes never write one run directory.

`RunLock(run_dir).acquire()` takes a non-blocking exclusive `flock` on `<run_dir>/run.lock`. The flock *is* the lock;
the JSON written into the file (pid, host, start time, argv) only says who holds it, so that a second launch fails at
once with a message naming the first. The kernel drops a flock when the last descriptor of its open file description
is closed, which happens when the holder exits for any reason, `kill -9` included: a lock left by a dead process never
blocks, and there is nothing stale to clean up. For the same reason the file is never deleted: a process that
deleted it while another waited could leave two processes each holding a lock on a different inode.

Descriptor inheritance. The descriptor is close-on-exec (Python's default), so programs started with `subprocess`
never hold the lock. A *forked* child (DataLoader workers with the `fork` start method, `os.fork`) would inherit it,
and the lock would then stay held for as long as that child lives, even after the parent died. To keep "the lock
lives exactly as long as the process that took it", an `os.register_at_fork` hook closes the inherited descriptor in
every child forked through Python (closing, never unlocking: `LOCK_UN` in the child would release the parent's
lock). A child forked outside Python's `os.fork` (C code calling fork() directly) keeps the descriptor until it exits;
such children die with their parent in practice (DataLoader workers watch their parent).

Shared holders. `RunLock(run_dir, shared=True)` takes `run.lock` in shared mode: shared holders coexist, and every
one of them excludes an exclusive holder (and the other way round). TorchFT replica groups of one run each hold it
shared (beside an exclusive lock of their own replica id, see `perdure/ft/replica.py`), so that a plain launch of the
same run, `perdure ckpt prune` or any other exclusive holder is refused while a group lives. A shared lock writes no
holder info into the file (several processes hold it at once).

Filesystems. flock is exact on local filesystems. On NFS (Linux >= 2.6.12) flock is emulated with byte-range locks,
which do conflict across hosts but not between two descriptors of one process; the in-process registry below makes a
second `RunLock` of the same file in the same process fail on every filesystem. Lustre needs the `flock` mount option;
without it flock raises ENOSYS/EINVAL, reported here as a `PerdureError` that says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from stat import S_ISREG
from types import TracebackType
from typing import Any, Protocol

from perdure.errors import PerdureError
from perdure.safe_io import ensure_dir, escape_terminal, kind_of, read_json

LOCK_NAME = "run.lock"
_READ_RETRIES = 10  # the holder truncates then writes its info: wait up to ~0.1 s for it to appear
_READ_RETRY_DELAY = 0.01
_RETRY_DELAY = 0.2  # between attempts of acquire(timeout=...)

# Locks held by this process, keyed by (st_dev, st_ino) of the lock file. Guards against a second RunLock of the same
# file in this process where flock alone would not (NFS), and lets the fork hook find every descriptor to close.
_HELD: dict[tuple[int, int], RunLock] = {}
_HELD_GUARD = threading.Lock()


class RunLockedError(PerdureError):
    """Another live process holds the lock of this run directory.

    `holder` is what the lock file says (may be empty or stale); `processes` the (pid, command line) of the processes
    this host sees holding the lock now, or None when it cannot tell (another host on NFS, no /proc). `pid` and `host`
    name the holder the message names: a live process, or the lock file's unverified note when nothing better is known.
    """

    def __init__(self, run_dir: Path, holder: dict[str, Any], processes: list[tuple[int, str]] | None = None):
        self.run_dir, self.holder = Path(run_dir), dict(holder)
        self.processes = processes
        self.pid: int | None = processes[0][0] if processes else holder.get("pid")
        self.host: str | None = socket.gethostname() if processes else holder.get("host")
        super().__init__(_locked_message(self.run_dir, self.holder, processes))


def _locked_message(run_dir: Path, holder: dict[str, Any], processes: list[tuple[int, str]] | None) -> str:
    why = "a lock left by a process that has died never blocks, so this one is alive"
    other = "to start a separate run beside it, give it another --workspace.id"
    if processes:
        pid, command = processes[0]
        if holder.get("pid") == pid and holder.get("host") == socket.gethostname():
            since = escape_terminal(holder.get("started", "<unknown time>"))
            who = f"pid {pid} on {socket.gethostname()} since {since} ({_short(holder.get('argv'))})"
        else:
            who = f"pid {pid} on {socket.gethostname()} ({_short(command)})"
        stop = f"`kill {pid}`" if pid > 1 else "stop that process"
        return f"run {run_dir} is in use by {who}; wait for it to end or stop it ({stop}; {why}); {other}."
    if holder.get("pid") is not None and holder.get("host") not in (None, socket.gethostname()):
        who = (
            f"a process on another host: run.lock names pid {holder['pid']} on {escape_terminal(holder['host'])} since "
            f"{escape_terminal(holder.get('started', '<unknown time>'))} ({_short(holder.get('argv'))}), which this "
            "host cannot verify"
        )
    else:
        who = "a process this host cannot identify (no process here has run.lock open; on a network filesystem it may "
        who += "be a process on another host)"
    return f"run {run_dir} is locked by {who}; wait for it to end or stop it ({why}); {other}."


def _short(text: Any, limit: int = 200) -> str:
    text = escape_terminal(str(text or ""))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def lock_holders(path: Path) -> list[tuple[int, str]] | None:
    """(pid, command line) of the live processes of this host that hold the flock of `path` now, or None when it
    cannot tell. Read from /proc/locks (the kernel's own table), checked against /proc/<pid>/fd where readable;
    when the process that took the lock has died but a forked child keeps it, the descriptors are scanned instead."""
    try:
        info = os.stat(path, follow_symlinks=False)
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    pids = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[1] != "FLOCK":  # "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END"; skips "->"
            continue
        try:
            pid, inode = int(fields[4]), int(fields[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        if inode == info.st_ino and pid > 0 and pid != os.getpid():
            pids.append(pid)
    holders = [pid for pid in dict.fromkeys(pids) if _has_open(pid, info) is not False]
    if not holders:
        holders = [pid for pid in _all_pids() if pid != os.getpid() and _has_open(pid, info)]
    return [(pid, _command_line(pid)) for pid in holders] or None


def _has_open(pid: int, info: os.stat_result) -> bool | None:
    """Whether process `pid` has the file of `info` open; None when its descriptors cannot be read."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except OSError:
        return None
    for name in names:
        try:
            other = os.stat(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (info.st_dev, info.st_ino):
            return True
    return False


def _all_pids() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command line unreadable"
    return " ".join(part.decode("utf-8", "replace") for part in raw.split(b"\0") if part) or "no command line"


class AttemptLock(Protocol):
    """The lock a runner holds while it may write its run, as the attempt lifecycle uses it
    (`perdure/runners/attempt.py`): a `RunLock`, or a TorchFT replica group's `perdure.ft.replica.ReplicaRunLock`."""

    @property
    def held(self) -> bool: ...

    def acquire(self, timeout: float = 0.0, announce: bool = True) -> None: ...

    def announce(self) -> None: ...

    def release(self) -> None: ...


class RunLock:
    """Exclusive, non-blocking lock of one run directory; see the module docstring for the guarantees.

    Use as `with RunLock(run_dir): ...` or `acquire()` / `release()`. Not re-entrant: acquiring a held lock, or a
    second `RunLock` of the same directory in this process, raises `RunLockedError` like any other holder would.
    """

    def __init__(self, run_dir: Path, name: str = LOCK_NAME, *, shared: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / name
        self.shared = shared
        self._fd: int | None = None
        self._key: tuple[int, int] | None = None
        self._info: dict[str, Any] = {}  # what this object wrote while it holds the lock
        self._announced = False  # whether `_info` is in the file

    @property
    def held(self) -> bool:
        """True while this object holds the lock (False in a forked child, which never holds it)."""
        return self._fd is not None

    def acquire(self, timeout: float = 0.0, announce: bool = True) -> None:
        """Take the lock or raise `RunLockedError` naming the holder; creates the run dir if needed.

        Non-blocking by default (fails at once). A positive `timeout` retries for that many seconds first, e.g. where
        a network filesystem keeps a crashed host's lock until its lease expires. `announce=False` takes the lock
        without writing who holds it into the file (a runner that may only look at the run changes no byte of it);
        `announce()` writes it later.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._try_acquire(announce)
                return
            except RunLockedError:
                if (left := deadline - time.monotonic()) <= 0:
                    raise
                time.sleep(min(_RETRY_DELAY, left))

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays; its content is cleared so nobody reads a finished holder."""
        fd, key = self._fd, self._key
        if fd is None:
            return
        self._fd = self._key = None
        with _HELD_GUARD:
            if key is not None and _HELD.get(key) is self:
                del _HELD[key]
        try:
            if self._announced:
                try:
                    os.ftruncate(fd, 0)  # still under the lock: never clears a later holder's info
                except OSError:
                    pass
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def holder(self) -> dict[str, Any]:
        """What the current holder wrote into the lock file ({} if nothing readable). Informational only."""
        return read_holder(self.path)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        shared = ", shared=True" if self.shared else ""
        return f"RunLock({str(self.run_dir)!r}, {self.path.name!r}{shared}, held={self.held})"

    def announce(self) -> None:
        """Write who holds the lock (pid, host, start time, argv) into the lock file, if not done yet."""
        if self._fd is None:
            raise PerdureError(f"{self!r}: announce() needs the lock held")
        if self.shared:
            raise PerdureError(f"{self!r}: a shared lock writes no holder info (several processes hold it at once)")
        if not self._announced:
            _write_info(self._fd, self._info)
            self._announced = True

    def _try_acquire(self, announce: bool = True) -> None:
        if self._fd is not None:
            raise RunLockedError(self.run_dir, self._info, [(os.getpid(), "this process")])
        ensure_dir(self.run_dir)
        fd = _open_lock_file(self.path)
        try:
            stat = os.fstat(fd)
            key = (stat.st_dev, stat.st_ino)
            with _HELD_GUARD:
                if (other := _HELD.get(key)) is not None:
                    raise RunLockedError(self.run_dir, other._info, [(os.getpid(), "this process")])
                _flock_or_raise(fd, self.run_dir, self.path, self.shared)
                self._info = _own_info()
                _HELD[key] = self
            self._fd, self._key = fd, key
        except BaseException:
            os.close(fd)
            raise
        self._announced = False
        if not announce or self.shared:
            return
        try:
            self.announce()
        except BaseException:
            self.release()
            raise

    def _forget_after_fork(self) -> None:
        """In a forked child: close the inherited descriptor without unlocking (the parent still holds it)."""
        fd, self._fd, self._key = self._fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _open_lock_file(path: Path) -> int:
    """Open (creating) the lock file for reading and writing: a regular file, never through a symlink."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except IsADirectoryError:
        raise PerdureError(
            f"{path} is a directory, not perdure's lock file; move it away (nothing in it is perdure's) and start again"
        ) from None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise PerdureError(
                f"{path} is a symlink; perdure never writes its lock through a symlink (it would truncate the file "
                "it points to). Remove the symlink and start again."
            ) from None
        raise
    info = os.fstat(fd)
    if not S_ISREG(info.st_mode):
        os.close(fd)
        raise PerdureError(f"{path} is {kind_of(info.st_mode)}, not perdure's lock file; move it away and start again")
    os.set_blocking(fd, True)
    return fd


def read_holder(path: Path) -> dict[str, Any]:
    """Parse the holder info in a lock file; {} if it is missing, empty or not JSON (e.g. being rewritten).
    Informational only, and possibly stale or hostile: a bounded read of a regular file; fields type-checked."""
    for attempt in range(_READ_RETRIES):
        try:
            info = read_json(path, limit=64 << 10, max_depth=4)
        except (OSError, ValueError):
            info = None
        if isinstance(info, dict) and isinstance(info.get("pid"), int) and not isinstance(info["pid"], bool):
            return {key: value if key == "pid" else str(value) for key, value in info.items()}
        if attempt + 1 < _READ_RETRIES:
            time.sleep(_READ_RETRY_DELAY)
    return {}


def _own_info() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": shlex.join(sys.argv) if sys.argv else sys.executable,
    }


def _flock_or_raise(fd: int, run_dir: Path, path: Path, shared: bool = False) -> None:
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunLockedError(run_dir, read_holder(path), lock_holders(path)) from None
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise RunLockedError(run_dir, read_holder(path), lock_holders(path)) from None
        raise PerdureError(
            f"cannot lock {path}: {exc}. The filesystem of the run dir does not support flock (on Lustre, mount with "
            "-o flock); put the workspace (--workspace.root) on a filesystem that does."
        ) from exc


def _write_info(fd: int, info: dict[str, Any]) -> None:
    data = (json.dumps(info) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _after_fork_in_child() -> None:
    # Only the forking thread survives a fork, so _HELD_GUARD may be held by a thread that no longer exists: do not
    # take it; replace it. The GIL was held across the fork, so the dict is not mid-update.
    global _HELD_GUARD
    _HELD_GUARD = threading.Lock()
    held = list(_HELD.values())
    _HELD.clear()
    for lock in held:
        lock._forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
