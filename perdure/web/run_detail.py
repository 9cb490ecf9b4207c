"""The run page's facts that are not checkpoints or curves: config and git state (from `metadata/`), the attempts and
the goodput (from the sidecar) and the log files (tailed, never loaded whole).

The metadata shown is the newest attempt's copy (`metadata/attempts/<attempt>/`), so a run extended with a larger
budget shows the budget it runs with now; a run from before per-attempt copies falls back to the top-level files.
"""

from __future__ import annotations

import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from perdure.web.files import KIB, MIB, Refused, StatCache, inside, read_head, read_tail, read_yaml, signature
from perdure.workspace.goodput import RUN_PARTS, is_goodput
from perdure.workspace.metadata import ATTEMPTS_DIR, METADATA_DIR
from perdure.workspace.sidecar import SIDECAR_NAME, SidecarError, parse_stamp, read_sidecar

YAML_LIMIT = 4 * MIB
GIT_DIFF_LIMIT = 256 * KIB
LOG_TAIL_DEFAULT = 64 * KIB
LOG_TAIL_MAX = 1 * MIB
LOGS_DIR = "logs"
_ATTEMPT_NAME = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]*$")


def iso(stamp: Any) -> str | None:
    """A sidecar stamp (`20261122T023011.123456Z`) as ISO 8601 UTC (`2026-11-22T02:30:11.123456Z`); other strings
    are returned as they are, anything else as None."""
    if not isinstance(stamp, str):
        return None
    seconds = parse_stamp(stamp)
    if seconds is None:
        return stamp[:64]
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def metadata_dir(root: Path, run_dir: Path) -> tuple[Path | None, str | None]:
    """(directory holding the newest attempt's metadata files, that attempt's name); (None, None) if none."""
    try:
        metadata = inside(root, run_dir / METADATA_DIR)
    except Refused:
        return None, None
    attempts = metadata / ATTEMPTS_DIR
    try:
        names = sorted(name for name in os.listdir(attempts) if _ATTEMPT_NAME.match(name))
    except OSError:
        names = []
    for name in reversed(names):
        try:
            return inside(root, attempts / name), name
        except Refused:
            continue
    return metadata, None


class MetadataReader:
    """Reads metadata YAML files inside a workspace root, each parsed once per change of the file."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()
        self._cache = StatCache()

    def yaml(self, path: Path) -> Any:
        """The parsed YAML at `path` (inside the root); `Refused` when missing, outside or unreadable."""
        resolved = inside(self.root, path)
        return self._cache.get(resolved, signature(resolved), lambda: read_yaml(resolved, YAML_LIMIT))

    def budget(self, run_dir: Path) -> tuple[int | None, str | None]:
        """(budget, unit) the newest attempt runs with, from its `config.full.yaml`: `steps`, else `epochs`."""
        directory, _ = metadata_dir(self.root, run_dir)
        if directory is None:
            return None, None
        try:
            config = self.yaml(directory / "config.full.yaml")
        except Refused:
            return None, None
        if not isinstance(config, dict):
            return None, None
        for unit in ("steps", "epochs"):
            value = config.get(unit)
            if isinstance(value, int) and not isinstance(value, bool):
                return value, unit
        return None, None

    def config(self, run_dir: Path) -> dict[str, Any]:
        """`{"attempt", "full", "diff", "git", "git_diff", "git_diff_truncated", "problems"}` for the run page."""
        directory, attempt = metadata_dir(self.root, run_dir)
        result: dict[str, Any] = {"attempt": attempt, "full": None, "diff": None, "git": None, "git_diff": None}
        result["git_diff_truncated"], problems = False, []
        if directory is None:
            result["problems"] = ["no metadata/ directory"]
            return result
        for key, name in (("full", "config.full.yaml"), ("diff", "config.diff.yaml"), ("git", "git.yaml")):
            try:
                result[key] = self.yaml(directory / name)
            except Refused as refused:
                problems.append(f"{name}: {refused.reason}")
        try:
            text, truncated = read_head(inside(self.root, directory / "git.diff"), GIT_DIFF_LIMIT)
            result["git_diff"], result["git_diff_truncated"] = text, truncated
        except Refused as refused:
            problems.append(f"git.diff: {refused.reason}")
        result["problems"] = problems
        return result


def attempts(root: Path, run_dir: Path) -> tuple[list[dict[str, Any]], str | None]:
    """The attempts recorded in the run's sidecar (oldest first) and a problem, if the sidecar cannot be read."""
    try:
        data = read_sidecar(inside(root, run_dir / SIDECAR_NAME))
    except Refused as refused:
        return [], f"{SIDECAR_NAME}: {refused.reason}"
    except SidecarError as error:
        return [], f"{SIDECAR_NAME}: {error.reason}"
    found = []
    for number, attempt in enumerate(data["attempts"], start=1):
        if not isinstance(attempt, dict):
            continue
        resumed_from = attempt.get("resumed_from")
        found.append(
            {
                "number": number,
                "started": iso(attempt.get("started")),
                "ended": iso(attempt.get("ended")),
                "status": _text(attempt.get("status")),
                "exit_reason": _text(attempt.get("exit_reason")),
                "resumed_from": Path(resumed_from).name if isinstance(resumed_from, str) and resumed_from else None,
                "resumed_step": _int(attempt.get("resumed_step")),
                "last_step": _int(attempt.get("last_step")),
                "steps_done": _int(attempt.get("steps_done")),
                "steps_lost": _int(attempt.get("steps_lost")),
                "save_seconds": attempt.get("save_seconds") if isinstance(attempt.get("save_seconds"), float) else None,
                "restart_counts": {
                    str(key): value
                    for key, value in (attempt.get("restart_counts") or {}).items()
                    if isinstance(value, int) or value is None
                }
                if isinstance(attempt.get("restart_counts"), dict)
                else {},
                "save_failures": [
                    {"checkpoint": _text(item.get("checkpoint")), "error": _text(item.get("error"))}
                    for item in attempt.get("save_failures") or []
                    if isinstance(item, dict)
                ],
                "goodput": _goodput(attempt.get("goodput")),
            }
        )
    return found, None


def run_goodput(root: Path, run_dir: Path) -> dict[str, Any] | None:
    """The run's goodput from its sidecar (`perdure.workspace.goodput`): `{"fraction", "seconds": {part: s}}` with
    the run's parts in order; None when it has none or the sidecar cannot be read (the attempts say why)."""
    try:
        data = read_sidecar(inside(root, run_dir / SIDECAR_NAME))
    except (Refused, SidecarError):
        return None
    return _goodput(data.get("goodput"))


def _goodput(value: Any) -> dict[str, Any] | None:
    """A goodput record as the page shows it: the fraction and the known parts' seconds, in order."""
    if not is_goodput(value):
        return None
    seconds = value["seconds"]
    return {"fraction": value["fraction"], "seconds": {part: seconds[part] for part in RUN_PARTS if part in seconds}}


def log_files(root: Path, run_dir: Path) -> list[dict[str, Any]]:
    """The run's `logs/*.log` files (regular files inside the root), oldest first: name and size."""
    try:
        logs = inside(root, run_dir / LOGS_DIR)
        entries = sorted(os.scandir(logs), key=lambda entry: entry.name)
    except (Refused, OSError):
        return []
    return [
        {"name": entry.name, "size": entry.stat(follow_symlinks=False).st_size}
        for entry in entries
        if entry.name.endswith(".log") and entry.is_file(follow_symlinks=False)
    ]


def log_tail(root: Path, run_dir: Path, name: str | None, limit: int) -> dict[str, Any]:
    """The last `limit` bytes of the log file `name` (one listed by `log_files`; default the newest).

    Refused when the run has no such log. The name is matched against the listing, never joined as given.
    """
    files = log_files(root, run_dir)
    if not files:
        raise Refused(run_dir / LOGS_DIR, "no log files")
    chosen = files[-1]["name"] if name is None else name
    if chosen not in {entry["name"] for entry in files}:
        raise Refused(chosen, "not a log file of this run")
    path = inside(root, run_dir / LOGS_DIR / chosen)
    text, truncated, size = read_tail(path, max(1, min(limit, LOG_TAIL_MAX)))
    return {"name": chosen, "size": size, "truncated": truncated, "text": text}


def _text(value: Any) -> str | None:
    return value[:4000] if isinstance(value, str) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
