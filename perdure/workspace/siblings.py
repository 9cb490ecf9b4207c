"""Sibling runs: the same lineage and config under another code identity, found so that a fresh start can say so.

A manual rerun after a commit starts a new run (the code identity is part of the directory's name). That is right
when the change matters, and a surprise when it does not: so a fresh start names the runs it could have continued and
the option that continues one (`--workspace.code_id`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from perdure.checkpoints.commit import read_manifest
from perdure.checkpoints.resolve import committed_checkpoints
from perdure.errors import CheckpointCorruptError

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
        return SiblingRun(
            path=run,
            code_id=code if isinstance(code, str) else code_from_name,
            checkpoint=path.name,
            step=step if isinstance(step, int) else None,
            age_s=_seconds_since(manifest.get("created")),
        )
    return None


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
