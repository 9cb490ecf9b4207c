"""The run registry: find, filter and rank the runs of a workspace, without any server.

Run directories are found as `<root>/*/*/sidecar.json`. `registry.db` (SQLite) at the root is only a cache of those
sidecars, keyed by run directory and refreshed incrementally (a sidecar is re-read only when its mtime or size
changed): delete it, or let it get corrupt, and the next scan rebuilds it with nothing lost. Where the root is not
writable the cache lives in memory.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from perdure.atomic import atomic_write_by_name, atomic_write_text
from perdure.config import flatten
from perdure.errors import PerdureError
from perdure.safe_io import UnsafeFileError, csv_text, is_regular_or_missing, kind_of, loads_json, move_aside
from perdure.workspace.goodput import is_goodput
from perdure.workspace.heartbeat import heartbeat_mtime
from perdure.workspace.run_dir import workspace_root
from perdure.workspace.sidecar import (
    SIDECAR_NAME,
    STALE,
    STATUSES,
    SidecarError,
    effective_status,
    read_sidecar,
    utc_stamp,
)

REGISTRY_NAME = "registry.db"
SCHEMA_VERSION = 2  # 2: the goodput column
EXPORT_SUFFIXES = (".csv", ".json", ".parquet")
_STATS = ("latest", "latest_step", "min", "min_step", "max", "max_step")
_COLUMNS = (
    "dir",
    "run_id",
    "lineage",
    "code_id",
    "config_id",
    "status",
    "tags",
    "hparams",
    "summary",
    "latest_checkpoint",
    "best_checkpoint",
    "created",
    "updated",
    "attempts",
    "step",
    "epoch",
    "goodput",
    "mtime_ns",
    "size",
)
_JSON_COLUMNS = ("tags", "hparams", "summary")
logger = logging.getLogger("perdure")
_SCHEMA = f"CREATE TABLE IF NOT EXISTS runs ({', '.join(_COLUMNS)}, PRIMARY KEY (dir))"


class RegistryError(PerdureError):
    """A registry query cannot be answered as asked (bad filter, unknown or ambiguous id, missing root, ...)."""


def missing_root(root: Path) -> str:
    """The message for a workspace root that is not a directory: what is there instead, and the fix."""
    there = "does not exist" if not os.path.lexists(root) else f"is {kind_of(os.lstat(root).st_mode)}, not a directory"
    return f"workspace root {root} {there}; pass --root DIR or set PERDURE_ROOT to where runs live"


class RunNotFoundError(RegistryError):
    """No run matches an id or prefix. `suggestions` holds the closest run ids."""

    def __init__(self, query: str, root: Path, suggestions: list[str]):
        self.query, self.suggestions = query, suggestions
        hint = f"closest: {', '.join(suggestions)}" if suggestions else "`perdure runs ls` lists the runs"
        super().__init__(f"no run '{query}' under {root}; {hint}")


class AmbiguousRunError(RegistryError):
    """An id or prefix matches several runs. `matches` holds their records."""

    def __init__(self, query: str, matches: list[RunRecord]):
        self.query, self.matches = query, matches
        listed = "\n  ".join(f"{record.run_id}  ({record.path})" for record in matches)
        super().__init__(f"'{query}' matches {len(matches)} runs; give more of the id:\n  {listed}")


@dataclass(frozen=True)
class RunRecord:
    """One run as the registry knows it. `status` is the effective one (`stale` included); `attempts` a count."""

    run_id: str
    lineage: str | None
    code_id: str | None
    config_id: str
    path: Path
    status: str
    tags: list[str]
    hparams: dict[str, Any]
    summary: dict[str, dict[str, Any]]
    latest_checkpoint: str | None
    best_checkpoint: str | None
    created: str | None
    updated: str | None
    attempts: int
    step: int | None = None
    epoch: int | None = None
    goodput: float | None = None  # the run's goodput fraction: kept training / wall time (sidecar.json's `goodput`)

    def metric(self, key: str, stat: str = "latest") -> float | None:
        """`summary[key][stat]` (`key` like `val/loss`, `stat` one of latest, min, max, ...), or None."""
        return (self.summary.get(key) or {}).get(stat)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (the path as a string)."""
        data = asdict(self)
        data["path"] = str(self.path)
        return data

    def flat(self) -> dict[str, Any]:
        """One flat row for tables: base fields, `hparams.<dotted key>`, `<split/name>.<stat>`."""
        row = {key: value for key, value in self.to_dict().items() if key not in ("hparams", "summary")}
        row["tags"] = ",".join(self.tags)
        row.update({f"hparams.{key}": value for key, value in flatten(self.hparams).items()})
        for metric in sorted(self.summary):
            row.update({f"{metric}.{stat}": self.metric(metric, stat) for stat in _STATS})
        return row


@dataclass(frozen=True)
class ScanIssue:
    """A sidecar the scan skipped, and why."""

    path: Path
    reason: str


@dataclass
class ScanReport:
    """What a scan did: sidecars found, (re)read into the cache, rows removed for deleted runs, sidecars skipped."""

    root: Path
    found: int = 0
    updated: int = 0
    removed: int = 0
    errors: list[ScanIssue] = field(default_factory=list)


class Registry:
    """The runs under a workspace root (default `$PERDURE_ROOT`, else `./runs`), cached in `<root>/registry.db`.

    Queries scan incrementally first, so they always see the sidecars as they are now; `last_scan` holds that
    scan's report (including the corrupt sidecars it skipped).
    """

    def __init__(self, root: Path | str | None = None, *, stale_after: float = 600.0) -> None:
        self.root = workspace_root(root).expanduser().absolute()
        self.stale_after = stale_after
        self.db_path = self.root / REGISTRY_NAME
        self.last_scan: ScanReport | None = None
        self._bad: dict[str, tuple[tuple[int, int], str]] = {}  # run dir -> (stat, reason) of a skipped sidecar
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.RLock()

    # ---- cache -------------------------------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            if not self.root.is_dir():
                raise RegistryError(missing_root(self.root))
            self._conn = _open_cache(self.db_path)
        return self._conn

    def close(self) -> None:
        """Close the cache connection (a later query reopens it)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def scan(self, *, full: bool = False) -> ScanReport:
        """Bring the cache up to date with the sidecars on disk; `full` re-reads every sidecar.

        Only sidecars whose (mtime_ns, size) changed are re-read; rows of deleted runs are removed; a corrupt
        sidecar is reported in `errors` and skipped. A cache found corrupt is deleted and rebuilt.
        """
        with self._lock:
            try:
                report = self._scan(full)
            except sqlite3.DatabaseError as error:
                if isinstance(error, sqlite3.OperationalError):
                    raise RegistryError(f"cannot update the run cache {self.db_path}: {error}") from None
                self.close()
                self.db_path.unlink(missing_ok=True)
                report = self._scan(full=True)
            self.last_scan = report
            return report

    def _scan(self, full: bool) -> ScanReport:
        db = self._db()
        report = ScanReport(self.root)
        on_disk = self._find_sidecars()
        report.found = len(on_disk)
        cached = {row[0]: (row[1], row[2]) for row in db.execute("SELECT dir, mtime_ns, size FROM runs")}
        gone = [name for name in cached if name not in on_disk]
        with db:
            db.executemany("DELETE FROM runs WHERE dir = ?", [(name,) for name in gone])
            report.removed = len(gone)
            for name, stat in on_disk.items():
                if not full and cached.get(name) == stat:
                    continue
                known_bad = self._bad.get(name)
                if not full and known_bad is not None and known_bad[0] == stat:
                    report.errors.append(ScanIssue(self.root / name / SIDECAR_NAME, known_bad[1]))
                    continue
                self._refresh(db, name, stat, report)
        self._bad = {name: bad for name, bad in self._bad.items() if name in on_disk}
        return report

    def _find_sidecars(self) -> dict[str, tuple[int, int]]:
        found = {}
        for path in sorted(self.root.glob(f"*/*/{SIDECAR_NAME}")):
            try:
                stat = path.stat()
            except OSError:  # removed while scanning
                continue
            found[path.parent.relative_to(self.root).as_posix()] = (stat.st_mtime_ns, stat.st_size)
        return found

    def _refresh(self, db: sqlite3.Connection, name: str, stat: tuple[int, int], report: ScanReport) -> None:
        path = self.root / name / SIDECAR_NAME
        try:
            data = read_sidecar(path)
        except SidecarError as error:
            db.execute("DELETE FROM runs WHERE dir = ?", (name,))
            self._bad[name] = (stat, error.reason)
            report.errors.append(ScanIssue(path, error.reason))
            return
        self._bad.pop(name, None)
        row = {
            "dir": name,
            "run_id": data["run_id"],
            "lineage": data.get("lineage"),
            "code_id": data.get("code_id"),
            "config_id": data["config_id"],
            "status": data.get("status"),
            "tags": json.dumps(data["tags"]),
            "hparams": json.dumps(data["hparams"]),
            "summary": json.dumps(data["summary"]),
            "latest_checkpoint": data.get("latest_checkpoint"),
            "best_checkpoint": data.get("best_checkpoint"),
            "created": data.get("created"),
            "updated": data.get("updated") or utc_stamp(stat[0] / 1e9),
            "attempts": len(data["attempts"]),
            "step": data.get("step"),
            "epoch": data.get("epoch"),
            "goodput": data["goodput"]["fraction"] if is_goodput(data.get("goodput")) else None,
            "mtime_ns": stat[0],
            "size": stat[1],
        }
        placeholders = ", ".join("?" for _ in _COLUMNS)
        db.execute(f"INSERT OR REPLACE INTO runs VALUES ({placeholders})", [row[column] for column in _COLUMNS])
        report.updated += 1

    # ---- queries -----------------------------------------------------------------------------------------------

    def runs(self, *, lineage: str | None = None, status: str | None = None, tag: str | None = None) -> list[RunRecord]:
        """Runs matching every filter given (`status` is the effective one, so `stale` works), newest update first."""
        if status is not None and status not in (*STATUSES, STALE):
            raise RegistryError(f"status filter {status!r}: use one of {', '.join((*STATUSES, STALE))}")
        self.scan()
        records, bad = self._records()
        if bad:  # a cache row of the wrong shape (registry.db is a file like any other): re-read those sidecars
            with self._lock, self._db() as db:
                db.executemany("DELETE FROM runs WHERE dir = ?", [(name,) for name in bad])
            self.scan()
            records, _ = self._records()
        records = [
            record
            for record in records
            if (lineage is None or record.lineage == lineage)
            and (status is None or record.status == status)
            and (tag is None or tag in record.tags)
        ]
        records.sort(key=lambda record: str(record.path))
        records.sort(key=lambda record: record.updated or "", reverse=True)
        return records

    def _records(self) -> tuple[list[RunRecord], list[str]]:
        """Every cached run as a record, and the run dirs whose cache rows are malformed."""
        with self._lock:
            rows = self._db().execute(f"SELECT {', '.join(_COLUMNS)} FROM runs").fetchall()
        records, bad = [], []
        for row in rows:
            try:
                records.append(self._record(dict(zip(_COLUMNS, row))))
            except (ValueError, TypeError):
                bad.append(row[0])
        return records, bad

    def _record(self, row: dict[str, Any]) -> RunRecord:
        """A cache row as a record; ValueError / TypeError when the row does not have the shape `_refresh` writes."""
        _check_row(row)
        path = self.root / row["dir"]
        raw = {"status": row["status"], "updated": row["updated"]}
        status = row["status"] or "unknown"
        if status == "running":
            status = effective_status(raw, heartbeat_mtime(path), stale_after=self.stale_after)
        values = {key: row[key] for key in _COLUMNS if key not in ("dir", "mtime_ns", "size")}
        values.update({key: loads_json(row[key]) for key in _JSON_COLUMNS})
        if not (isinstance(values["tags"], list) and all(isinstance(tag, str) for tag in values["tags"])):
            raise TypeError("tags")
        if not isinstance(values["hparams"], dict) or not isinstance(values["summary"], dict):
            raise TypeError("hparams / summary")
        if not all(isinstance(entry, dict) for entry in values["summary"].values()):
            raise TypeError("summary")
        return RunRecord(**{**values, "path": path, "status": status})

    def get(self, id_or_prefix: str) -> RunRecord:
        """The run whose id (or `<group>/<id>` directory) is `id_or_prefix`, else the one it is a unique prefix of.

        Raises `AmbiguousRunError` listing the matches, or `RunNotFoundError` listing the closest ids.
        """
        query = id_or_prefix.strip().strip("/")
        records = self.runs()

        def names(record: RunRecord) -> tuple[str, str]:
            return record.run_id, record.path.relative_to(self.root).as_posix()

        for matches in (
            [record for record in records if query in names(record)],
            [record for record in records if any(name.startswith(query) for name in names(record))],
        ):
            if len(matches) == 1:
                return matches[0]
            if matches:
                raise AmbiguousRunError(id_or_prefix, matches)
        ids = sorted({record.run_id for record in records})
        raise RunNotFoundError(id_or_prefix, self.root, difflib.get_close_matches(query, ids, n=5, cutoff=0.3))

    def metrics(self, **filters: Any) -> list[str]:
        """Every metric key (`split/name`) in the summaries of the runs matching `filters`, sorted."""
        return sorted({key for record in self.runs(**filters) for key in record.summary})

    def best(
        self,
        metric: str,
        *,
        maximize: bool = False,
        lineage: str | None = None,
        status: str | None = None,
        tag: str | None = None,
        limit: int | None = None,
    ) -> list[tuple[RunRecord, float]]:
        """Runs ranked by the best value of `metric` (`split/name`, e.g. `val/loss`) they reached: the summary's
        min (or max with `maximize`), best first. Runs without that metric are left out."""
        if "/" not in metric:
            raise RegistryError(f"metric {metric!r}: name it split/name, e.g. val/loss or train/loss")
        stat = "max" if maximize else "min"
        scored = [
            (record, value)
            for record in self.runs(lineage=lineage, status=status, tag=tag)
            if (value := record.metric(metric, stat)) is not None
        ]
        scored.sort(key=lambda pair: pair[1], reverse=maximize)  # stable: ties keep the newest first
        return scored if limit is None else scored[:limit]

    def export(self, path: Path | str, **filters: Any) -> Path:
        """Write the runs matching `filters` (lineage, status, tag) to `path`: `.csv` (one flat row per run),
        `.json` (a list of full records) or `.parquet` (flat rows; needs pyarrow). Returns the path."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix not in EXPORT_SUFFIXES:
            raise RegistryError(f"cannot export to {path}: use a file name ending in {', '.join(EXPORT_SUFFIXES)}")
        if suffix == ".parquet":
            _require_pyarrow()
        records = self.runs(**filters)
        path.parent.mkdir(parents=True, exist_ok=True)
        if suffix == ".json":
            atomic_write_text(path, json.dumps([record.to_dict() for record in records], indent=2) + "\n")
        elif suffix == ".csv":
            atomic_write_text(path, _csv([record.flat() for record in records]))
        else:
            _write_parquet(path, [record.flat() for record in records])
        return path


# ---------------------------------------------------------------------- helpers


def _open_cache(db_path: Path) -> sqlite3.Connection:
    """The cache at `db_path`, created or rebuilt as needed: a corrupt one is deleted (it holds nothing that the
    sidecars do not), one of another schema version is emptied, an unwritable root gets an in-memory cache. SQLite
    would write through a symlink: a symlink (or anything but a regular file) named like the cache or its journal
    is moved aside first, its target untouched."""
    for path in (db_path, *(db_path.with_name(db_path.name + suffix) for suffix in ("-journal", "-wal", "-shm"))):
        try:
            is_regular_or_missing(path)
        except UnsafeFileError as error:
            try:
                aside = move_aside(path, "unexpected")
            except OSError:
                return _connect(Path(":memory:"))
            logger.warning("%s; moved it to %s (its target is untouched): the run cache is rebuilt", error, aside.name)
    for _ in range(2):
        try:
            return _connect(db_path)
        except sqlite3.OperationalError:  # read-only root, or a lock held for longer than the timeout
            break
        except sqlite3.DatabaseError:  # not a database, malformed
            try:
                db_path.unlink(missing_ok=True)
            except OSError:
                break
    return _connect(Path(":memory:"))


def _connect(db_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(db_path), timeout=30, check_same_thread=False)
    try:
        if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
            with conn:
                conn.execute("DROP TABLE IF EXISTS runs")
                conn.execute(_SCHEMA)
                conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("SELECT count(*) FROM runs").fetchone()
        conn.execute("BEGIN IMMEDIATE")  # can we write? (raises OperationalError when read-only)
        conn.execute("ROLLBACK")
    except BaseException:
        conn.close()
        raise
    return conn


_ROW_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("dir", "run_id", "config_id", "tags", "hparams", "summary"), (str,)),
    **dict.fromkeys(("lineage", "code_id", "status", "latest_checkpoint", "best_checkpoint"), (str, type(None))),
    **dict.fromkeys(("created", "updated"), (str, type(None))),
    **dict.fromkeys(("attempts", "mtime_ns", "size"), (int,)),
    **dict.fromkeys(("step", "epoch"), (int, type(None))),
    "goodput": (float, int, type(None)),
}


def _check_row(row: dict[str, Any]) -> None:
    for key, kinds in _ROW_TYPES.items():
        if isinstance(row[key], bool) or not isinstance(row[key], kinds):
            raise TypeError(f"cache column {key} holds a {type(row[key]).__name__}")
    parts = row["dir"].split("/")
    if len(parts) != 2 or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"cache row names {row['dir']!r}, not a run directory under the root")


def _cell(value: Any) -> Any:
    """A value for one CSV cell: lists and dicts as JSON, None as empty, text that no spreadsheet reads as a formula
    (`csv_text`); numbers as they are."""
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        value = json.dumps(value)
    if isinstance(value, bool):
        value = str(value)  # quoted like any text: only numbers stay unquoted
    return csv_text(value) if isinstance(value, str) else value


def _columns(rows: Iterable[dict[str, Any]]) -> list[str]:
    """Union of the rows' keys: base fields first, then `hparams.*` sorted, then metrics sorted (stats in order)."""
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    base = [key for key in columns if not key.startswith("hparams.") and "/" not in key]
    hparams = sorted(key for key in columns if key.startswith("hparams."))
    metrics = [key for key in columns if key not in base and key not in hparams]

    def metric_order(key: str) -> tuple[str, int]:
        metric, _, stat = key.rpartition(".")
        return metric, _STATS.index(stat) if stat in _STATS else len(_STATS)

    return base + hparams + sorted(metrics, key=metric_order)


def _csv(rows: list[dict[str, Any]]) -> str:
    """One row per run. Every text cell is quoted (so a CR or LF inside a value never splits a row) and no cell,
    header included, starts like a formula: names and values come from sidecars, which may come from anyone."""
    stream = io.StringIO()
    columns = _columns(rows)
    writer = csv.writer(stream, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    writer.writerow([csv_text(column) for column in columns])
    for row in rows:
        writer.writerow([_cell(row.get(column)) for column in columns])
    return stream.getvalue()


def _require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise RegistryError(
            "exporting .parquet needs pyarrow, which is not installed: pip install pyarrow (or export to .csv / .json)"
        ) from None


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = _columns(rows)
    data: dict[str, list[Any]] = {}
    for column in columns:
        values = [row.get(column) for row in rows]
        values = [json.dumps(value) if isinstance(value, (list, dict)) else value for value in values]
        kinds = {type(value) for value in values if value is not None}
        if kinds - {int, float} and len(kinds) > 1:  # mixed types: one column needs one type
            values = [None if value is None else str(value) for value in values]
        elif kinds == {int, float}:
            values = [None if value is None else float(value) for value in values]
        data[column] = values
    table = pa.table(data)
    atomic_write_by_name(path, lambda temporary: pq.write_table(table, temporary))
