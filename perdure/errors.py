"""Every error perdure raises on purpose: each names what was wrong and how to fix it."""

from __future__ import annotations

import os

# PERDURE_TRACEBACK=1: a PerdureError that ends a program or a `perdure` command also prints its traceback.
TRACEBACK_ENV = "PERDURE_TRACEBACK"


def show_traceback() -> bool:
    """Whether `PERDURE_TRACEBACK` asks for the traceback of a `PerdureError` (normally one line `error: ...`)."""
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class PerdureError(Exception):
    """Base of perdure's own errors. The message alone must tell the user what to do; no traceback is needed."""


class ConfigError(PerdureError, ValueError):
    """A config key holds a value perdure cannot use. Raised before anything is written."""

    def __init__(self, key: str, value: object, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"config key '{key}' = {value!r}: {fix}")


class CheckpointError(PerdureError):
    """A checkpoint cannot be used (missing, corrupt, or made by a different config)."""


class WeightsMisfitError(CheckpointError):
    """Weights whose names or shapes do not fit the model. Refused from their metadata, before any tensor is read; as
    `--pretrained` of a new run, bad input refused before anything is written (no run directory, no failed attempt)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint directory failed verification. `reason` says which file and how."""

    def __init__(self, path: object, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"checkpoint {path} is not valid: {reason}")


class ResumeError(PerdureError):
    """The requested restore cannot be honoured without losing or overwriting committed work."""


class WorkspaceError(PerdureError):
    """The workspace cannot take the run: its directory cannot be created under the root (a file in the way, no
    permission, a read-only or full disk), or the attempt's first records cannot be written there (a full disk).
    Raised before the first training step; the message names the path, why, and the fix."""


class CodeIdentityError(WorkspaceError):
    """The program runs from a git checkout that git cannot read (no git on PATH, a broken index, ...): its code
    identity, which names the run, is unknown. Raised before anything is written, with git's message and the fix."""


class StackNotAvailableError(PerdureError):
    """The configured `stack` is not implemented in this version."""


class CheckpointSaveError(CheckpointError):
    """A save failed (disk full, I/O error, ...). Committed checkpoints are intact; the message says which save."""


class CheckpointStateError(CheckpointError):
    """No save of this attempt can ever work: the state cannot be serialized at all (a user object torch cannot save),
    or (DCP, several ranks) a checkpoint process died while starting and the other ranks' wait for it. The run stops
    at that save instead of training on without checkpoints; the message says why and what to do."""


class UnsafeFileError(PerdureError, OSError):
    """A path perdure will not read or write as it is: a symlink where none belongs, a FIFO, a device, a directory
    where a file belongs, a file over its size bound (see `perdure.safe_io`). An `OSError`, so callers that handle
    unreadable files handle this one too. `path` and `reason` say which and why."""

    def __init__(self, path: object, reason: str) -> None:
        self.path, self.reason = path, reason
        super().__init__(f"{path} {reason}")


class RunStuckError(PerdureError):
    """The run's last attempts each ended without a new checkpoint (`resilience.max_attempts_without_progress`): it
    is marked `stuck` and the launch exits 93 ("do not requeue") before building anything."""
