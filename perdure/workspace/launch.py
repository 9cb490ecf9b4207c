"""Launches and their restarts: a requeued job continues the run directory its launch started in.

A *launch* is one job as the scheduler sees it: a SLURM job (or one task of an array), one torchrun elastic run, or
one job of a `perdure sweep`.
The scheduler may restart it — a SLURM requeue (`SLURM_RESTART_COUNT` >= 1), a torchrun elastic restart
(`TORCHELASTIC_RESTART_COUNT` >= 1) — with whatever code the checkout holds at that moment. Since a run directory is
named by the code identity, a commit between two attempts would otherwise start the requeued job over in a new
directory. So the first attempt of a launch records its run directory in the workspace's launch index, and every
restart of the same launch continues that directory, whatever changed in the checkout.

    <root>/.launches/<hash>.json    one entry per (launch, lineage, config identity, workspace.id)

The entry is keyed by the config identity too, so that one batch script that trains two configs finds each its own
directory. An interactive rerun inside the same allocation (same job id, no restart count) is a fresh launch and
replaces the entry. The index is only a pointer: entries are small JSON files written atomically by rank 0 when
training starts, read with bounds, and never trusted to name a path outside the workspace root.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from perdure.atomic import atomic_write_text

LAUNCH_INDEX_DIR = ".launches"
LAUNCH_ENV, RESTART_ENV = "PERDURE_LAUNCH_ID", "PERDURE_RESTART_COUNT"
ENTRY_FORMAT = "perdure-launch/1"
MAX_ENTRY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Launch:
    """The launch this process belongs to: `key` names it, `restart` counts its restarts (0: the first attempt)."""

    key: str
    restart: int

    @property
    def is_restart(self) -> bool:
        return self.restart >= 1

    def describe(self) -> str:
        return f"{self.key} (restart {self.restart})" if self.is_restart else self.key


def _count(environ: Mapping[str, str], name: str) -> int:
    try:
        return max(int(environ.get(name, "0")), 0)
    except ValueError:
        return 0


def current_launch(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch described by the scheduler's environment, or None for a plain process.

    `PERDURE_LAUNCH_ID` / `PERDURE_RESTART_COUNT`, set by a launcher of perdure's own (`perdure sweep run` sets them
    for each job, the restart count being its earlier attempts), win. SLURM wins over torchrun (a torchrun inside a
    SLURM job gets a new elastic run id when SLURM requeues the job):
    `SLURM_ARRAY_JOB_ID`_`SLURM_ARRAY_TASK_ID` for an array task, else `SLURM_JOB_ID`; restarted when
    `SLURM_RESTART_COUNT` or `TORCHELASTIC_RESTART_COUNT` is >= 1. Otherwise `TORCHELASTIC_RUN_ID`, restarted when
    `TORCHELASTIC_RESTART_COUNT` is >= 1.
    """
    env = os.environ if environ is None else environ
    if env.get(LAUNCH_ENV):  # a launcher of our own (the sweep dispatcher) knows best
        return Launch(f"perdure:{env[LAUNCH_ENV]}", _count(env, RESTART_ENV))
    elastic_restarts = _count(env, "TORCHELASTIC_RESTART_COUNT")
    if env.get("SLURM_JOB_ID"):
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            key = f"slurm:{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        else:
            key = f"slurm:{env['SLURM_JOB_ID']}"
        return Launch(key, max(_count(env, "SLURM_RESTART_COUNT"), elastic_restarts))
    if env.get("TORCHELASTIC_RUN_ID"):
        return Launch(f"torchelastic:{env['TORCHELASTIC_RUN_ID']}", elastic_restarts)
    return None


def entry_path(root: Path, launch: Launch, *, lineage: str, config_id: str, workspace_id: str | None) -> Path:
    """The index file of one (launch, lineage, config identity, workspace.id)."""
    key = json.dumps([launch.key, lineage, config_id, workspace_id or ""])
    return Path(root) / LAUNCH_INDEX_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def read_entry(path: Path, root: Path) -> dict[str, Any] | None:
    """The run directory an index entry names, as `{"run_dir": relative path, "code_id": ...}`; None when there is
    no usable entry (missing, not a regular file, too large, malformed, or naming a path outside the root)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not _is_regular(fd):
            return None
        data = os.read(fd, MAX_ENTRY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_ENTRY_BYTES:
        return None
    try:
        entry = json.loads(data)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT:
        return None
    relative, code = entry.get("run_dir"), entry.get("code_id")
    if not isinstance(relative, str) or not _inside(relative) or not isinstance(code, (str, type(None))):
        return None
    if not isinstance(entry.get("run_id"), str):
        return None
    return entry


def write_entry(path: Path, *, launch: Launch, run_dir: Path, root: Path, code_id: str | None, run_id: str) -> None:
    """Record (atomically) that `launch` trains in `run_dir`, whose directory carries `code_id`."""
    relative = Path(os.path.relpath(Path(run_dir).absolute(), Path(root).absolute())).as_posix()
    if not _inside(relative):
        return  # a run dir outside the root (an explicit absolute path) cannot be found again through the root
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"format": ENTRY_FORMAT, "launch": launch.key, "run_dir": relative, "code_id": code_id, "run_id": run_id}
    atomic_write_text(path, json.dumps(entry, indent=2) + "\n")


def _inside(relative: str) -> bool:
    pure = PurePosixPath(relative)
    return bool(relative) and not pure.is_absolute() and ".." not in pure.parts and "\0" not in relative


def _is_regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)


def record_launch(run_dir: Any) -> None:
    """At the start of a launch's first attempt (rank 0, training starts): index the run directory it trains in, so
    that a restart of the same launch continues it. Nothing to do for a restart or outside a launch."""
    launch, root = run_dir.launch, run_dir.root
    if launch is None or launch.is_restart or root is None:
        return
    index = entry_path(
        root, launch, lineage=run_dir.lineage, config_id=run_dir.config_id, workspace_id=run_dir.workspace_id
    )
    write_entry(index, launch=launch, run_dir=run_dir.path, root=root, code_id=run_dir.code_id, run_id=run_dir.run_id)
