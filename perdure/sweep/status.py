"""What `perdure sweep status` shows: one view per job (the `--json` contract) and the counts per state.

`--json` prints exactly `{"jobs": [{"id", "overrides", "state", "attempts", "host", "slot", "run_dir",
"last_metric"}], "counts": {state: int}}` (every state counted, zeros included). `last_metric` is the latest
value of the run's score metric (`score.split/score.metric`, e.g. `val/loss`) from its `sidecar.json`, else of
`train/loss`, as `{name: value}`; null when the run has logged neither (or has no run dir yet).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from perdure.sweep.matrix import SweepError
from perdure.sweep.slurm import merged_state, slurm_view
from perdure.sweep.state import FINAL, JOB_STATES, JobRow, SweepState, read_regular_file
from perdure.workspace.sidecar import SIDECAR_FORMAT, SIDECAR_NAME

MAX_SIDECAR_BYTES = 16 << 20
JOB_KEYS = ("id", "overrides", "state", "attempts", "host", "slot", "run_dir", "last_metric")


def status_view(state: SweepState, *, use_slurm: bool = True) -> dict[str, Any]:
    """The `--json` document: every job's view, then the counts (SLURM's state merged in for unfinished rows)."""
    pending = [row.slurm_job for row in state.jobs if row.slurm_job and row.state not in FINAL]
    view = slurm_view(pending) if use_slurm and pending else {}
    jobs = [job_view(row, merged_state(row, view)) for row in state.jobs]
    counts = dict.fromkeys(JOB_STATES, 0)
    for job in jobs:
        counts[job["state"]] += 1
    return {"jobs": jobs, "counts": counts}


def job_view(row: JobRow, state: str) -> dict[str, Any]:
    return {
        "id": row.id,
        "overrides": dict(row.overrides),
        "state": state,
        "attempts": row.attempts,
        "host": row.host,
        "slot": row.slot,
        "run_dir": row.run_dir,
        "last_metric": last_metric(row.run_dir),
    }


def last_metric(run_dir: str | None) -> dict[str, float | None] | None:
    """`{name: latest value}` of the run's score metric (else train/loss) from its sidecar; None if unknown."""
    if run_dir is None:
        return None
    data = read_sidecar_summary(Path(run_dir) / SIDECAR_NAME)
    if data is None:
        return None
    summary, score = data
    names = [f"{score.get('split')}/{score.get('metric')}"] if score else []
    for name in [*names, "train/loss"]:
        entry = summary.get(name)
        if isinstance(entry, dict) and "latest" in entry:
            value = entry["latest"]
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            return {name: value if number else None}
    return None


def read_sidecar_summary(path: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(summary, score section) of a perdure sidecar, or None when there is none that reads as one. The run dir
    came from a log, so the file is read only if regular and at most `MAX_SIDECAR_BYTES`."""
    try:
        data = json.loads(read_regular_file(path, MAX_SIDECAR_BYTES))
    except (SweepError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != SIDECAR_FORMAT or not isinstance(data.get("summary"), dict):
        return None
    hparams = data.get("hparams")
    score = hparams.get("score") if isinstance(hparams, dict) else None
    return data["summary"], score if isinstance(score, dict) else {}


def status_json(view: dict[str, Any]) -> str:
    return json.dumps(view, indent=2, allow_nan=False, default=str)
