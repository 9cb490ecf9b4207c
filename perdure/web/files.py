"""Careful reads of run files for the web viewer: inside the workspace root, regular files only, bounded in size.

Every file the viewer opens itself (metrics.csv, media.jsonl, logs, metadata YAML, media images) goes through these
helpers. A path is resolved (symlinks followed) and must stay inside the workspace root, else it is `Refused`, which
the server answers with 404. Opening uses `O_NOFOLLOW | O_NONBLOCK` and checks the opened file is a regular one, so a
symlink swapped in after the check, a FIFO or a device is refused too, and nothing blocks.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import yaml

KIB = 1024
MIB = 1024 * KIB
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
# A YAML document may share nodes through aliases; expanded (as JSON does) it may not exceed these.
YAML_MAX_NODES = 200_000
YAML_MAX_DEPTH = 64

T = TypeVar("T")


class Refused(Exception):
    """A path the viewer will not read: missing, outside the root, a symlink out of it, not a regular file, or too
    large. `reason` says which (for logs and tests; the client only ever sees 404)."""

    def __init__(self, path: object, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


def inside(root: Path, path: Path) -> Path:
    """`path` with every symlink resolved, if it exists and stays inside `root` (resolved too); else `Refused`."""
    try:
        resolved = Path(path).resolve(strict=True)
    except (OSError, RuntimeError):  # missing, or a symlink loop
        raise Refused(path, "does not exist") from None
    if not resolved.is_relative_to(Path(root).resolve()):
        raise Refused(path, f"resolves to {resolved}, outside the workspace root")
    return resolved


def join_inside(root: Path, base: Path, relative: str) -> Path:
    """`base / relative` resolved, for a `relative` path that came from outside (a URL, a media index).

    Refused unless `relative` is a plain relative posix path (no `..`, no leading `/`, no backslash or NUL) and the
    result, symlinks resolved, stays inside both `base` and `root`.
    """
    pure = PurePosixPath(relative)
    if (
        not relative
        or pure.is_absolute()
        or ".." in pure.parts
        or "\\" in relative
        or "\0" in relative
        or relative.startswith("~")
    ):
        raise Refused(relative, "not a plain relative path")
    resolved = inside(root, Path(base) / relative)
    if not resolved.is_relative_to(Path(base).resolve()):
        raise Refused(relative, f"resolves to {resolved}, outside {base}")
    return resolved


def _open_regular(path: Path) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as error:
        raise Refused(path, f"cannot open: {error.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise Refused(path, "not a regular file")
    return fd, info


def _read_at(fd: int, offset: int, count: int) -> bytes:
    chunks, done = [], 0
    while done < count:
        chunk = os.pread(fd, min(count - done, 4 * MIB), offset + done)
        if not chunk:
            break
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def read_bytes(path: Path, limit: int) -> bytes:
    """The whole content of a regular file of at most `limit` bytes (a larger one is `Refused`)."""
    fd, info = _open_regular(path)
    try:
        if info.st_size > limit:
            raise Refused(path, f"{info.st_size} bytes, more than the {limit} this viewer reads")
        return _read_at(fd, 0, limit + 1)[:limit]
    finally:
        os.close(fd)


def read_text(path: Path, limit: int) -> str:
    """`read_bytes` decoded as UTF-8 (undecodable bytes replaced)."""
    return read_bytes(path, limit).decode("utf-8", errors="replace")


def read_tail(path: Path, limit: int) -> tuple[str, bool, int]:
    """The last `limit` bytes of a regular file as text, starting at a line boundary when cut.

    Returns (text, truncated, size of the file). Only the tail is read, however large the file is.
    """
    fd, info = _open_regular(path)
    try:
        start = max(info.st_size - limit, 0)
        data = _read_at(fd, start, info.st_size - start)
    finally:
        os.close(fd)
    if start > 0:
        newline = data.find(b"\n")
        data = data[newline + 1 :] if newline >= 0 else data
    return data.decode("utf-8", errors="replace"), start > 0, info.st_size


def read_head(path: Path, limit: int) -> tuple[str, bool]:
    """The first `limit` bytes of a regular file as text; (text, truncated)."""
    fd, info = _open_regular(path)
    try:
        data = _read_at(fd, 0, min(info.st_size, limit))
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace"), info.st_size > limit


def read_yaml(path: Path, limit: int) -> Any:
    """A YAML file parsed with `yaml.safe_load`, bounded: at most `limit` bytes, and at most `YAML_MAX_NODES` nodes
    and `YAML_MAX_DEPTH` levels once aliases are expanded (so an alias bomb cannot explode into the JSON we send).
    Refused when unreadable, too large or not valid YAML."""
    text = read_text(path, limit)
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as error:
        raise Refused(path, f"not valid YAML: {str(error)[:200]}") from None
    _check_size(path, data)
    return data


def _check_size(path: Path, data: Any) -> None:
    nodes = 0
    stack = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > YAML_MAX_NODES or depth > YAML_MAX_DEPTH:
            raise Refused(path, f"YAML expands past {YAML_MAX_NODES} nodes or {YAML_MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def signature(path: Path) -> tuple[int, int, int, int] | None:
    """(device, inode, size, mtime_ns) of `path` without following a symlink, or None if it does not exist."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


class StatCache:
    """Values computed from a file, recomputed only when the file's `signature` changes. Thread-safe; holds at most
    `capacity` entries (the oldest is dropped first)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._entries: dict[Any, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def peek(self, key: Any, stamp: Any) -> Any | None:
        """The value cached under `key` if it was computed at the same `stamp`, else None."""
        with self._lock:
            hit = self._entries.get(key)
        return hit[1] if hit is not None and hit[0] == stamp else None

    def get(self, key: Any, stamp: Any, compute: Callable[[], T]) -> T:
        """The value cached under `key` if it was computed at the same `stamp`; else `compute()`, cached."""
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = compute()
        with self._lock:
            self._entries.pop(key, None)
            self._entries[key] = (stamp, value)
            while len(self._entries) > self.capacity:
                self._entries.pop(next(iter(self._entries)))
        return value
