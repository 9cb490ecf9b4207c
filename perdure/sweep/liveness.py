"""Who is alive: dispatchers announce themselves in `DIR/dispatchers/<id>.json` and keep its mtime fresh (the
heartbeat); a job's process is recognised by its pid and its start time (so a reused pid is not mistaken for it).

A dispatcher is dead when its file is gone, or, on this host, when its process is gone, or, on another host, when
its heartbeat is older than `stale_after` seconds. Only then may another dispatcher requeue its rows: a live
dispatcher's jobs are never taken.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from perdure.atomic import atomic_write_text
from perdure.sweep.matrix import SweepError
from perdure.sweep.state import read_regular_file
from perdure.workspace.sidecar import utc_stamp

DISPATCHERS_DIR = "dispatchers"
STALE_AFTER_S = 60.0
_MAX_RECORD_BYTES = 4096
_DISPATCHER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,200}$")


def hostname() -> str:
    return socket.gethostname()


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, from /proc), or None if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as file:
            text = file.read(4096).decode("ascii", "replace")
        return int(text.rsplit(")", 1)[1].split()[19])  # field 22; the name in (...) may hold spaces
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid: int | None, start: int | None) -> bool:
    """True if `pid` runs on this host and is the process that started at `start` (any process if start is None)."""
    if pid is None or pid <= 0:
        return False
    now = process_start_time(pid)
    if now is None:
        return False
    if start is None:
        return True
    return now == start


@dataclass(frozen=True)
class DispatcherRecord:
    """What a dispatcher wrote about itself."""

    id: str
    host: str
    pid: int
    pid_start: int | None
    started: str


class DispatcherHeartbeat:
    """This process as a dispatcher of a sweep: `beat()` at every poll, `remove()` on a clean exit."""

    def __init__(self, sweep_dir: str | os.PathLike) -> None:
        self.host, self.pid = hostname(), os.getpid()
        self.id = f"{self.host}-{self.pid}-{secrets.token_hex(3)}"
        self.path = Path(sweep_dir) / DISPATCHERS_DIR / f"{self.id}.json"
        self.path.parent.mkdir(exist_ok=True)
        if self.path.parent.is_symlink():
            raise SweepError(f"{self.path.parent} is a symlink: perdure does not write through links in a sweep dir")
        record = {"id": self.id, "host": self.host, "pid": self.pid, "pid_start": process_start_time(self.pid)}
        record["started"] = utc_stamp()
        atomic_write_text(self.path, json.dumps(record) + "\n")

    def beat(self) -> None:
        os.utime(self.path, follow_symlinks=False)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def read_dispatcher(sweep_dir: str | os.PathLike, dispatcher_id: str) -> tuple[DispatcherRecord, float] | None:
    """The record and heartbeat (mtime) of a dispatcher, or None if it left no (readable) record."""
    if not _DISPATCHER_ID.match(dispatcher_id):
        return None
    path = Path(sweep_dir) / DISPATCHERS_DIR / f"{dispatcher_id}.json"
    try:
        data = json.loads(read_regular_file(path, _MAX_RECORD_BYTES))
        mtime = path.stat().st_mtime
        record = DispatcherRecord(
            id=str(data["id"]),
            host=str(data["host"]),
            pid=int(data["pid"]),
            pid_start=None if data.get("pid_start") is None else int(data["pid_start"]),
            started=str(data.get("started")),
        )
    except (SweepError, OSError, ValueError, KeyError, TypeError):
        return None
    return record, mtime


def dispatcher_alive(sweep_dir: str | os.PathLike, dispatcher_id: str, stale_after: float = STALE_AFTER_S) -> bool:
    """See the module docstring."""
    found = read_dispatcher(sweep_dir, dispatcher_id)
    if found is None:
        return False
    record, heartbeat = found
    if record.host == hostname():
        return process_alive(record.pid, record.pid_start)
    return time.time() - heartbeat < stale_after
