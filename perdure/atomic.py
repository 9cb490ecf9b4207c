"""The one atomic write: a reader sees the old content or the new one, never a mix, and a crash right after it returns
keeps the new one. A leaf module: it imports nothing else of perdure.

    atomic_write(path, lambda file: file.write(data))   # any writer of a binary file object
    atomic_write_text(path, text)
    atomic_write_by_name(path, lambda temporary: save_file(tensors, temporary))   # a library that wants a file name

The bytes go to a new hidden sibling `.<name>.tmp-<pid>-<random>` (created exclusively, never through a symlink), are
fsynced, renamed over `path`, and the directory is fsynced. On every failure (the writer raising half-way, a full disk,
a rename the directory refuses, a KeyboardInterrupt) the temporary file is removed and `path` is left as it was.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

TEMPORARY_MARK = ".tmp-"  # in the name of every temporary file written here


class RecordingWriter:
    """The binary file a writing library gets: counts the bytes the file accepted and keeps the first `OSError` it
    raised, since a library may report that as something else (torch's zip writer turns a full disk's ENOSPC into
    `RuntimeError: ... unexpected pos`); `naming_os_error` gives it back. Append-only: `tell` is the bytes written."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            written = self._file.write(view)
        except OSError as error:
            self.error = self.error or error
            raise
        written = len(view) if written is None else written
        self.accepted(view[:written])
        self._size += written
        return written

    def accepted(self, data: memoryview) -> None:
        """Called with each piece of bytes the file accepted, in order (a subclass hashes them). Must not write."""

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        return self._size

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


def naming_os_error(error: BaseException, recorded: OSError | None, path: Path) -> BaseException | None:
    """The `OSError` to raise instead of `error` from a write of `path`: the file's own (`recorded`) when a library
    re-raised it as something else, or `error` with `path` when it names no file (a write or fsync); None: keep it."""
    cause = recorded if recorded is not None else error
    if isinstance(cause, OSError) and (cause is not error or not cause.filename):
        return OSError(cause.errno, cause.strerror, str(path))
    return None


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


def atomic_write(
    path: str | os.PathLike[str], write: Callable[[BinaryIO], object], *, mode: int = 0o644, durable: bool = True
) -> None:
    """Replace `path` with what `write(file)` writes, atomically (see the module's docstring). With `durable=False`
    nothing is fsynced: a reader still never sees a mix, but a power loss may keep the old content (a file rewritten
    every few seconds, such as `sidecar.json`). An I/O failure is raised as an `OSError` naming `path`, whatever the
    writing library made of it."""
    writers: list[RecordingWriter] = []

    def fill(temporary: Path, fd: int) -> None:
        with os.fdopen(fd, "wb") as file:
            writers.append(RecordingWriter(file))
            write(writers[0])  # type: ignore[arg-type]  # what a writer uses of a BinaryIO: write, flush, tell
            file.flush()
            if durable:
                os.fsync(file.fileno())

    _replace(Path(path), fill, lambda: writers[0].error if writers else None, mode=mode, durable=durable)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace `path` with `text` (UTF-8, newlines as given), atomically and durably."""
    data = text.encode("utf-8")
    atomic_write(path, lambda file: file.write(data))


def atomic_write_by_name(path: str | os.PathLike[str], write: Callable[[Path], object], *, mode: int = 0o644) -> None:
    """`atomic_write` for a library that writes to a file name, not a file object (safetensors' `save_file`, pyarrow):
    `write(temporary)` fills the temporary sibling, which exists (empty) when it is called."""

    def fill(temporary: Path, fd: int) -> None:
        os.close(fd)
        write(temporary)
        fd = os.open(temporary, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    _replace(Path(path), fill, lambda: None, mode=mode, durable=True)


def _replace(
    path: Path, fill: Callable[[Path, int], None], recorded: Callable[[], OSError | None], *, mode: int, durable: bool
) -> None:
    """Create the temporary sibling exclusively, let `fill(temporary, fd)` write it (and close `fd`), rename it over
    `path`; on any failure remove it, leave `path` as it was, and raise what `naming_os_error` makes of the error
    (`recorded()`: the first `OSError` the file itself raised)."""
    temporary = temporary_sibling(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(temporary, flags, mode)  # before the `try`: a name this call did not create is never removed
    try:
        fill(temporary, fd)
        os.replace(temporary, path)
    except BaseException as error:
        temporary.unlink(missing_ok=True)
        named = naming_os_error(error, recorded(), path)
        if named is not None:
            raise named from error
        raise
    if durable:
        fsync_dir(path.parent)
