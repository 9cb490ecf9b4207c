"""Why a save failed, in words a user can act on, and whether training may go on without it.

Two kinds of failure, told apart by the exception chain:

- **I/O** (a full disk, a quota, a read-only or vanished filesystem, a rank that did not deliver its share): an
  `OSError` anywhere in the chain, however a library wrapped it (torch's zip writer turns ENOSPC into
  `RuntimeError: ... unexpected pos`; DCP reports each rank's exception in a `CheckpointException`), or perdure's own
  `CheckpointError`. The save fails, its partial directory goes, every committed checkpoint stays, and an interval
  save lets training go on (`ckpt.on_error`).
- **State** that cannot be serialized at all (a user object torch cannot pickle): no save will ever work, so the run
  fails at its first save with a `CheckpointStateError`.
"""

from __future__ import annotations

import errno
import shutil
import signal
import sys
from pathlib import Path

from perdure.errors import CheckpointError, CheckpointSaveError, CheckpointStateError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def io_cause(error: BaseException) -> OSError | None:
    """The `OSError` behind `error`: itself, one in its `__cause__` / `__context__` chain, or one that a DCP
    `CheckpointException` reports for any rank. None when the failure is not an I/O failure."""
    dcp = sys.modules.get("torch.distributed.checkpoint.api")  # not loaded: no CheckpointException can exist
    stack: list[BaseException | None] = [error]
    seen: set[int] = set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        if dcp is not None and isinstance(
            current, dcp.CheckpointException
        ):  # each failed rank's (exception, traceback)
            stack.extend(item[0] if isinstance(item, tuple) else item for item in current.failures.values())
        stack.extend((current.__context__, current.__cause__))
    return None


def save_failure(error: BaseException, *, name: str, root: Path, needed: int = 0) -> CheckpointError:
    """The error to report for a save of checkpoint `name` into `root` that raised `error`: a `CheckpointSaveError`
    (I/O: training may go on) naming the real cause, or a `CheckpointStateError` (state that can never be saved)."""
    if isinstance(error, (CheckpointSaveError, CheckpointStateError)):
        return error  # made by perdure for this very purpose
    cause = io_cause(error)
    if cause is None and not isinstance(error, CheckpointError):
        failure: CheckpointError = CheckpointStateError(
            f"checkpoint {name} could not be written: its state cannot be serialized ({_first_line(error)}). "
            "Everything a checkpoint holds (the model, optimizer, scheduler, EMA, your self.checkpointed objects, what "
            "extra_states() and checkpoint_states() return) must be tensors and plain data that torch.save can write"
        )
    elif cause is None:
        failure = CheckpointSaveError(_first_line(error))
    else:
        failure = CheckpointSaveError(describe_io_error(cause, root=root, needed=needed, wrapper=error))
    return failure


def killed_by(exit_code: int | None) -> str | None:
    """`SIGKILL (the out-of-memory killer sends it: see `dmesg`)` for a process that a signal ended, else None."""
    if exit_code is None or exit_code >= 0:
        return None
    number = -exit_code
    name = signal.Signals(number).name if number in signal.valid_signals() else f"signal {number}"
    return f"{name} (the out-of-memory killer sends it: see `dmesg`)" if number == signal.SIGKILL else name


def describe_io_error(cause: OSError, *, root: Path, needed: int = 0, wrapper: BaseException | None = None) -> str:
    """One line: what failed, on which path, and for a full disk how much the checkpoint needs against what is free."""
    text = what_failed(cause, root)
    if cause.errno in _NO_SPACE:
        free = free_bytes(root)
        needs = f"the checkpoint needs about {human_bytes(needed)}, " if needed else ""
        has = f"{human_bytes(free)} free on that filesystem now" if free is not None else "free space unknown"
        text += f": {needs}{has}; free space (or lower ckpt.keep_latest_k) and rerun the same command to resume"
    if wrapper is not None and wrapper is not cause:
        text += f" [reported as {type(wrapper).__name__}: {_first_line(wrapper, 120)}]"
    return text


def what_failed(cause: OSError, where: Path) -> str:
    """`No space left on device (ENOSPC) writing <file>`: the error, its code, the file (else `where`)."""
    code = errno.errorcode.get(cause.errno or 0, "")
    what = cause.strerror or str(cause)
    return f"{what} ({code}) writing {cause.filename or where}" if code else f"{what} writing {cause.filename or where}"


def free_bytes(path: Path) -> int | None:
    """Bytes free for an unprivileged writer on the filesystem of `path` (its nearest existing ancestor)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def _first_line(error: BaseException, limit: int = 400) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else ""
    line = line if len(line) <= limit else line[: limit - 3] + "..."
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
