"""Sibling runs: the same lineage and config under another code identity.

The code identity is part of a run directory's name, so a rerun after a commit (or a pull, or an edit of an
unrelated tracked file) finds no checkpoint under its own name. A fresh launch in that case continues the sibling
that is unfinished (`unfinished_sibling`: its status is not `completed`), in that sibling's directory; a completed
sibling is only named (a new run starts), with the option that continues it (`--workspace.code_id`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from perdure.checkpoints.commit import read_manifest
from perdure.checkpoints.resolve import committed_checkpoints
from perdure.errors import CheckpointCorruptError
from perdure.workspace.sidecar import SIDECAR_NAME, SidecarError, read_sidecar

MAX_GROUPS = 200
MAX_RUNS = 1000


@dataclass(frozen=True)
class SiblingRun:
    """A run directory of the same lineage and config whose newest checkpoint is `checkpoint`."""

    path: Path
    code_id: str | None
    checkpoint: str
    step: int | None
    age_s: float | None
    status: str | None = None  # the sidecar's (None: no readable sidecar)
    lineage: str | None = None  # the sidecar's
    last_code_id: str | None = None  # the code the run's last attempt ran (the sidecar's)

    @property
    def unfinished(self) -> bool:
        """A run that has not completed, known from its sidecar (a run without one is not continued implicitly)."""
        return self.status is not None and self.status != "completed"

    def describe(self) -> str:
        step = "?" if self.step is None else str(self.step)
        return f"{self.path} (step {step}, code {self.code_id or '?'}, last checkpoint {_age(self.age_s)})"


def sibling_runs(
    root: Path, *, lineage: str, config_id: str, workspace_id: str | None, exclude: Path
) -> list[SiblingRun]:
    """Runs under `root/<lineage>-*/` with committed checkpoints of config `config_id`, other than `exclude`, newest
    first. With `workspace_id` only directories of that name count. Bounded: a huge workspace is sampled, not read."""
    root = Path(root)
    found: list[SiblingRun] = []
    try:
        groups = sorted(p for p in root.iterdir() if p.name.startswith(f"{lineage}-"))[:MAX_GROUPS]
    except OSError:
        return found
    scanned = 0
    for group in groups:
        try:
            runs = [group / workspace_id] if workspace_id else sorted(group.iterdir())
        except OSError:
            continue
        for run in runs:
            scanned += 1
            if scanned > MAX_RUNS:
                break
            if run.is_symlink() or not run.is_dir() or run.absolute() == Path(exclude).absolute():
                continue
            sibling = _newest(run, config_id, group.name[len(lineage) + 1 :])
            if sibling is not None:
                found.append(sibling)
    return sorted(found, key=lambda s: s.age_s if s.age_s is not None else float("inf"))


def _newest(run: Path, config_id: str, code_from_name: str) -> SiblingRun | None:
    for path in committed_checkpoints(run / "checkpoints")[:3]:
        try:
            manifest = read_manifest(path)
        except CheckpointCorruptError:
            continue
        if manifest.get("config_id") != config_id:
            return None
        step = manifest.get("global_step")
        code = manifest.get("code_id")
        sidecar = _sidecar(run)
        attempts = sidecar.get("attempts") or [{}]
        return SiblingRun(
            path=run,
            code_id=code if isinstance(code, str) else code_from_name,
            checkpoint=path.name,
            step=step if isinstance(step, int) else None,
            age_s=_seconds_since(manifest.get("created")),
            status=sidecar.get("status"),
            lineage=sidecar.get("lineage"),
            last_code_id=attempts[-1].get("code_id") if isinstance(attempts[-1].get("code_id"), str) else None,
        )
    return None


def _sidecar(run: Path) -> dict:
    try:
        return read_sidecar(run / SIDECAR_NAME)
    except SidecarError:
        return {}


def unfinished_sibling(siblings: list[SiblingRun], *, lineage: str, running_code_id: str | None) -> SiblingRun | None:
    """The sibling a fresh launch (no checkpoint under its own name) continues: the run this very code already
    continued (its last attempt ran `running_code_id`), else the unfinished one with the newest checkpoint. Only runs
    whose sidecar names the same lineage count (a lineage `mlp` must not take a run of `mlp-big`)."""
    same = [sibling for sibling in siblings if sibling.lineage == lineage and sibling.status is not None]
    ours = [s for s in same if running_code_id is not None and s.last_code_id == running_code_id]
    unfinished = [sibling for sibling in same if sibling.unfinished]
    found = ours or unfinished
    return found[0] if found else None


def _seconds_since(created: object) -> float | None:
    try:
        return max(time.time() - datetime.fromisoformat(str(created)).timestamp(), 0.0)
    except ValueError:
        return None


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "at an unknown time"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"
