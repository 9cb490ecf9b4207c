"""The workspace as the web viewer sees it: the runs table, one run's page, its curves and its images, as plain
JSON-ready data. No web library is needed here; `app.py` only routes to these methods.

A run's id in the viewer (and the API) is its directory relative to the workspace root, `<lineage group>/<run dir>`
(e.g. `mlp-7b00c1a/7b00c1a-ff00af502d42`): unique across the workspace, stable, and the same name `perdure runs show`
accepts. Runs come from the registry (`Registry.runs`, which rescans the sidecars incrementally on every call); a run
whose directory resolves outside the root (a symlinked run dir) is left out, as are all its files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from perdure.checkpoints.commit import CHECKPOINT_PATTERN
from perdure.web.checkpoint_status import CHECKPOINTS_DIR, CheckpointVerifier, checkpoint_table
from perdure.web.files import Refused, StatCache, inside, join_inside, signature
from perdure.web.run_detail import MetadataReader, attempts, iso, log_files, log_tail, run_goodput
from perdure.web.series import (
    IMAGE_SUFFIXES,
    MEDIA_DIR,
    add_train_time,
    downsample,
    read_media,
    read_metrics,
)
from perdure.workspace.registry import Registry, RunRecord

METRICS_FILE = "metrics.csv"
MEDIA_INDEX = "media.jsonl"
DEFAULT_MAX_POINTS = 5000


class UnknownRun(Refused):
    """No run of the workspace has this id."""


def run_url(run_id: str) -> str:
    """The URL path segment(s) of a run id: each part percent-encoded."""
    return "/".join(quote(part, safe="") for part in run_id.split("/"))


class WorkspaceView:
    """Read-only views of the runs under `root` for the web viewer. Thread-safe (the registry and caches lock)."""

    def __init__(self, root: Path | str | None, *, stale_after: float = 600.0) -> None:
        self.registry = Registry(root, stale_after=stale_after)
        self.root = self.registry.root.resolve()
        self.metadata = MetadataReader(self.root)
        self.verifier = CheckpointVerifier(self.root)
        self._series = StatCache(capacity=256)
        self._media = StatCache(capacity=256)

    def close(self) -> None:
        self.registry.close()

    # ---- runs ----------------------------------------------------------------------------------------------

    def scan(self, *, full: bool = False) -> dict[str, Any]:
        """Refresh the registry cache; what the scan found, read, removed and skipped."""
        report = self.registry.scan(full=full)
        return {
            "found": report.found,
            "updated": report.updated,
            "removed": report.removed,
            "skipped": [{"path": self._relative(issue.path), "reason": issue.reason} for issue in report.errors],
        }

    def records(self) -> dict[str, RunRecord]:
        """Every run of the workspace whose directory stays inside the root, by viewer id."""
        found = {}
        for record in self.registry.runs():
            try:
                inside(self.root, record.path)
            except Refused:
                continue
            found[record.path.relative_to(self.registry.root).as_posix()] = record
        return found

    def record(self, run_id: str) -> tuple[RunRecord, Path]:
        """The run with viewer id `run_id` and its resolved directory; `UnknownRun` if there is none."""
        record = self.records().get(run_id)
        if record is None:
            raise UnknownRun(run_id, "no such run")
        return record, inside(self.root, record.path)

    def runs(self) -> list[dict[str, Any]]:
        """One row per run, newest update first: every column of the runs page, plus `summary` for scripts."""
        return [self._row(run_id, record) for run_id, record in self.records().items()]

    def _row(self, run_id: str, record: RunRecord) -> dict[str, Any]:
        budget, unit = self.metadata.budget(record.path)
        metric, mode = _score_metric(record)
        entry = record.summary.get(metric) or {}
        checkpoint = record.latest_checkpoint
        verified, problem, checked = self._latest_verified(record.path, checkpoint)
        return {
            "id": run_id,
            "url": f"/runs/{run_url(run_id)}",
            "run_id": record.run_id,
            "lineage": record.lineage,
            "code_id": record.code_id,
            "config_id": record.config_id,
            "status": record.status,
            "attempts": record.attempts,
            "step": record.step,
            "epoch": record.epoch,
            "budget": budget,
            "budget_unit": unit,
            "metric": metric,
            "metric_mode": mode,
            "metric_latest": entry.get("latest"),
            "metric_best": entry.get(mode),
            "metric_best_step": entry.get(f"{mode}_step"),
            "checkpoint": checkpoint,
            "checkpoint_verified": verified,
            "checkpoint_problem": problem,
            "checkpoint_checked": checked,
            "started": iso(record.created),
            "updated": iso(record.updated),
            "tags": record.tags,
            "summary": record.summary,
        }

    def _latest_verified(self, run_dir: Path, name: str | None) -> tuple[bool | None, str | None, str | None]:
        """(verifies, problem, what was compared: "sizes" or "checksums") for the run's latest checkpoint.

        Answered from sizes at once, or from checksums once the background check (queued here) has hashed it.
        """
        if not name:
            return None, None, None
        if not CHECKPOINT_PATTERN.match(name):
            return False, "the sidecar names no checkpoint directory", None
        result = self.verifier.check(run_dir / CHECKPOINTS_DIR / name, deep=False, background=True)
        return result.verified, result.problem, "checksums" if result.deep else "sizes"

    # ---- one run -------------------------------------------------------------------------------------------

    def run(self, run_id: str) -> dict[str, Any]:
        """Everything the run page shows: the table row, config and its diff, git state, attempts, checkpoints
        (verified from sizes at once, by checksums in the background) and the log files (tails come from `log`)."""
        record, path = self.record(run_id)
        history, problem = attempts(self.root, path)
        return {
            **self._row(run_id, record),
            "hparams": record.hparams,
            "best_checkpoint": record.best_checkpoint,
            "config": self.metadata.config(path),
            "attempt_list": history,
            "attempts_problem": problem,
            "goodput": run_goodput(self.root, path),
            "checkpoints": checkpoint_table(path, self.verifier),
            "logs": log_files(self.root, path),
        }

    def log(self, run_id: str, name: str | None, limit: int) -> dict[str, Any]:
        """The tail of one of the run's log files (the newest by default)."""
        _, path = self.record(run_id)
        return log_tail(self.root, path, name, limit)

    def metrics(self, run_id: str, max_points: int = DEFAULT_MAX_POINTS) -> dict[str, Any]:
        """`{"id", "metrics": {"split/name": {"step", "value", "time"}}, "time_source"}` from the run's metrics.csv.

        Each series keeps at most `max_points` points (evenly strided, the last one kept). `time` (seconds of
        training, see `series.add_train_time`) is present only when the run logged its speed.
        """
        record, path = self.record(run_id)
        series: dict[str, Any] = {}
        source = None
        try:
            csv_path = inside(self.root, path / METRICS_FILE)
            series, source = self._series.get(csv_path, signature(csv_path), lambda: _load_series(csv_path))
        except Refused:
            pass
        limited = {key: downsample(entry, max(2, max_points)) for key, entry in sorted(series.items())}
        return {"id": run_id, "status": record.status, "metrics": limited, "time_source": source}

    def media(self, run_id: str) -> dict[str, Any]:
        """`{"id", "media": [{"tag", "step", "index", "url"}]}` from the run's media.jsonl."""
        _, path = self.record(run_id)
        records: list[dict[str, Any]] = []
        try:
            index = inside(self.root, path / MEDIA_INDEX)
            records = self._media.get(index, signature(index), lambda: self._servable(path, read_media(index)))
        except Refused:
            pass
        prefix = f"/files/{run_url(run_id)}/"
        media = [
            {"tag": item["tag"], "step": item["step"], "index": item["index"], "url": prefix + run_url(item["path"])}
            for item in records
        ]
        return {"id": run_id, "media": media}

    def _servable(self, run_dir: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records whose image would be served (a listed path may be missing, a symlink out of the run, ...)."""
        kept = []
        for item in records:
            try:
                self._image(run_dir, item["path"])
            except Refused:
                continue
            kept.append(item)
        return kept

    def media_file(self, run_id: str, relative: str) -> tuple[Path, str]:
        """(resolved path, media type) of an image under the run's `media/`; `Refused` for anything else."""
        _, path = self.record(run_id)
        return self._image(path, relative)

    def _image(self, run_dir: Path, relative: str) -> tuple[Path, str]:
        resolved = join_inside(self.root, run_dir, relative)
        media_root = inside(self.root, run_dir / MEDIA_DIR)
        if not resolved.is_relative_to(media_root):
            raise Refused(relative, "not under the run's media/")
        kind = IMAGE_SUFFIXES.get(resolved.suffix.lower())
        if kind is None:
            raise Refused(relative, "not an image file")
        if not resolved.is_file():
            raise Refused(relative, "not a regular file")
        return resolved, kind

    def _relative(self, path: Path) -> str:
        try:
            return Path(path).relative_to(self.registry.root).as_posix()
        except ValueError:
            return str(path)


def _load_series(path: Path) -> tuple[dict[str, Any], str | None]:
    series = read_metrics(path)
    return series, add_train_time(series)


def _score_metric(record: RunRecord) -> tuple[str, str]:
    """The metric the runs table shows: the run's score metric (`score.split/score.metric`, best by `score.mode`)
    when it logged it, else `train/loss` (lower is better)."""
    score = record.hparams.get("score")
    if isinstance(score, dict):
        key = f"{score.get('split')}/{score.get('metric')}"
        mode = "max" if score.get("mode") == "max" else "min"
        if key in record.summary:
            return key, mode
    return "train/loss", "min"
