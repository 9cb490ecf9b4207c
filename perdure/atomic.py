"""The one atomic write: a reader sees the old content or the new one, never a mix, and a crash right after it returns
keeps the new one. A leaf module: it imports nothing else of perdure.

    atomic_write(path, lambda file: file.write(data))   # any writer of a binary file object
    atomic_write_text(path, text)

The bytes go to a new hidden sibling `.<name>.tmp-<pid>-<random>` (created exclusively, never through a symlink), are
fsynced, renamed over `path`, and the directory is fsynced. On every failure (the writer raising half-way, a full disk,
a rename the directory refuses, a KeyboardInterrupt) the temporary file is removed and `path` is left as it was.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMPORARY_MARK = ".tmp-"  # in the name of every temporary file written here


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that entries created, renamed or removed in it survive a crash."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_sibling(path: Path) -> Path:
    """An unpredictable hidden sibling of `path` to write before the rename."""
    return path.with_name(f".{path.name}{TEMPORARY_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, mode: int = 0o644) -> None:
    """Replace `path` with what `write(file)` writes, atomically and durably (see the module's docstring)."""
    path = Path(path)
    temporary = temporary_sibling(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        with os.fdopen(os.open(temporary, flags, mode), "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        if error.filename is None:  # a write or fsync names no file: say which one (a full disk's ENOSPC)
            raise OSError(error.errno, error.strerror, str(path)) from error
        raise
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace `path` with `text` (UTF-8, newlines as given), atomically and durably."""
    data = text.encode("utf-8")
    atomic_write(path, lambda file: file.write(data))
