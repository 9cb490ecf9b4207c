"""`sidecar.json`: a run's status, identity, hparams, summary metrics and attempts, readable without loading anything.

The runner replaces it atomically at every log flush and checkpoint, then touches the `heartbeat` file beside it. The
run registry is built from sidecars alone. A run whose sidecar says `running` but whose heartbeat is older than a
threshold is shown as `stale` (the process died without a word: SIGKILL, node failure, ...).

Times are sortable UTC stamps like `20261122T023011.123456Z` (`utc_stamp()`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from perdure.atomic import atomic_write
from perdure.errors import PerdureError
from perdure.resilience.rank_heartbeat import last_beat as ranks_last_beat
from perdure.resilience.rank_heartbeat import reached_step as ranks_reached_step
from perdure.safe_io import (
    ensure_dir,
    is_symlink,
    read_json,
    safe_name,
)
from perdure.workspace.goodput import attempt_goodput, clock_is_valid, is_goodput, run_goodput
from perdure.workspace.heartbeat import heartbeat_mtime, heartbeat_step, touch_heartbeat

SIDECAR_NAME = "sidecar.json"
SIDECAR_FORMAT = "perdure-sidecar/1"
STATUSES = ("running", "completed", "failed", "preempted", "stopped", "stuck", "hung", "killed")
STALE = "stale"
# Status of an attempt that never recorded its end (the next attempt found it still `running`).
INTERRUPTED = "interrupted"
STAMP_FORMAT = "%Y%m%dT%H%M%S.%fZ"
_STATS = ("latest", "latest_step", "min", "min_step", "max", "max_step")

logger = logging.getLogger("perdure")


class SidecarError(PerdureError):
    """A sidecar file cannot be read or is not a perdure sidecar. `path` and `reason` say which and why."""

    def __init__(self, path: object, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"sidecar {path} is not valid: {reason}")


def utc_stamp(when: float | None = None) -> str:
    """`when` (a POSIX time, default now) as a sortable UTC stamp, e.g. `20261122T023011.123456Z`."""
    moment = datetime.now(timezone.utc) if when is None else datetime.fromtimestamp(when, timezone.utc)
    return moment.strftime(STAMP_FORMAT)


def parse_stamp(stamp: str) -> float | None:
    """POSIX time of a stamp written by `utc_stamp` (with or without the fraction); None if it is not one."""
    for fmt in (STAMP_FORMAT, "%Y%m%dT%H%M%SZ"):
        try:
            return datetime.strptime(stamp, fmt).replace(tzinfo=timezone.utc).timestamp()
        except (TypeError, ValueError):
            continue
    return None


class Sidecar:
    """The sidecar of one run. Mutate it with `start_attempt`, `record`, `finish_attempt`; persist with `write`.

    Constructing it loads the attempts, summary and checkpoints of an existing `sidecar.json`; a corrupt file is
    moved aside to `sidecar.json.corrupt-<stamp>` with a warning and a fresh history starts. Thread-safe.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        run_id: str,
        lineage: str,
        code_id: str | None,
        config_id: str,
        hparams: Mapping[str, Any],
        tags: Sequence[str],
    ) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / SIDECAR_NAME
        self._lock = threading.RLock()
        now = utc_stamp()
        self._data: dict[str, Any] = {
            "format": SIDECAR_FORMAT,
            "run_id": run_id,
            "lineage": lineage,
            "code_id": code_id,
            "config_id": config_id,
            "path": os.path.abspath(self.run_dir),
            "status": None,
            "tags": list(tags),
            "hparams": _plain(hparams),
            "step": None,
            "epoch": None,
            "summary": {},
            "latest_checkpoint": None,
            "best_checkpoint": None,
            "attempts": [],
            "created": now,
            "updated": now,
        }
        earlier = self._load_earlier()
        if earlier is not None:
            for key in ("status", "step", "epoch", "summary", "latest_checkpoint", "best_checkpoint", "attempts"):
                self._data[key] = earlier.get(key, self._data[key])
            self._data["created"] = earlier.get("created") or now

    def _load_earlier(self) -> dict[str, Any] | None:
        if not self.path.exists() and not is_symlink(self.path):
            return None
        try:
            return read_sidecar(self.path)
        except SidecarError as error:
            aside = self.path.with_name(f"{SIDECAR_NAME}.corrupt-{utc_stamp()}")
            os.replace(self.path, aside)  # a symlink is moved itself, its target untouched
            logger.warning("%s; moved it to %s and started a fresh run history", error, aside.name)
            return None

    # ---- mutations ---------------------------------------------------------------------------------------------

    def start_attempt(
        self,
        *,
        started: str,
        restart_counts: Mapping[str, int | None],
        resumed_from: str | None,
        resumed_step: int,
        details: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Append an attempt that starts at `resumed_step` and set the status to `running`. Returns the entry.

        `restart_counts` records e.g. SLURM_RESTART_COUNT / TORCHELASTIC_RESTART_COUNT; `details` (the code the
        attempt runs, its world size, a topology change, ...) is stored in the entry as is. `steps_lost` is the work the
        interruption cost: how far the previous attempt got past the checkpoint this one resumes from (the step its
        ranks' heartbeats last recorded, which a SIGKILL leaves in place); the previous attempt's goodput counts
        them as lost. A previous attempt still marked running never recorded its end: it becomes `interrupted`,
        ended at its last heartbeat.
        """
        with self._lock:
            attempts = self._data["attempts"]
            previous = attempts[-1] if attempts else None
            self._end_unrecorded(previous)
            lost = 0
            if previous is not None:
                reached = self._reached_step(previous)
                lost = max(reached - int(resumed_step), 0)
                previous["last_step"] = reached  # a killed attempt trained past its last record
                previous["steps_done"] = max(reached - int(previous.get("resumed_step") or 0), 0)
                self._settle_goodput(previous, reached_step=reached, kept_step=int(resumed_step))
            attempt = {
                "started": started,
                "ended": None,
                "exit_reason": None,
                "status": "running",
                "resumed_from": resumed_from,
                "resumed_step": int(resumed_step),
                "restart_counts": dict(restart_counts),
                "steps_done": 0,
                "last_step": int(resumed_step),
                "steps_lost": lost,
                "save_seconds": 0.0,
                "save_failures": [],
                **_plain(dict(details or {})),
            }
            attempts.append(attempt)
            self._data["status"] = "running"
            self._data.pop("stuck_reason", None)
            self._data["step"] = int(resumed_step)
            return attempt

    def record(
        self,
        *,
        step: int | None = None,
        epoch: int | None = None,
        metrics: Mapping[str, Mapping[str, float]] | None = None,
        latest_checkpoint: str | None = None,
        best_checkpoint: str | None = None,
        save_seconds: float = 0.0,
    ) -> None:
        """Record progress: the step / epoch reached, metrics (`{split: {name: value}}`, logged at `step`, default
        the last step recorded), checkpoints committed and seconds spent saving. Non-finite values count as latest
        (written as null) but never as min / max."""
        with self._lock:
            attempt = self.current_attempt
            if step is not None:
                self._data["step"] = int(step)
                if attempt is not None:
                    attempt["last_step"] = int(step)
                    attempt["steps_done"] = max(int(step) - attempt["resumed_step"], 0)
            if epoch is not None:
                self._data["epoch"] = int(epoch)
            if latest_checkpoint is not None:
                self._data["latest_checkpoint"] = str(latest_checkpoint)
            if best_checkpoint is not None:
                self._data["best_checkpoint"] = str(best_checkpoint)
            if save_seconds and attempt is not None:
                attempt["save_seconds"] = round(attempt["save_seconds"] + float(save_seconds), 6)
            at = self._data["step"] if step is None else int(step)
            for split, values in (metrics or {}).items():
                for name, value in values.items():
                    self._update_summary(f"{split}/{name}", _finite(value), at)

    def _update_summary(self, key: str, value: float | None, step: int | None) -> None:
        entry = {**dict.fromkeys(_STATS), **(self._data["summary"].get(key) or {})}
        entry["latest"], entry["latest_step"] = value, step
        if value is not None:
            if entry["min"] is None or value < entry["min"]:
                entry["min"], entry["min_step"] = value, step
            if entry["max"] is None or value > entry["max"]:
                entry["max"], entry["max_step"] = value, step
        self._data["summary"][key] = entry

    def _reached_step(self, attempt: Mapping[str, Any]) -> int:
        """How far `attempt` (the one before the attempt starting now) trained: its last record, or further as its
        heartbeats last said (the run's `heartbeat` and its ranks' `heartbeats/`, which a SIGKILL leaves in place)."""
        reached = max(int(attempt.get("last_step") or 0), heartbeat_step(self.run_dir) or 0)
        return max(reached, ranks_reached_step(self.run_dir, str(attempt.get("started"))) or 0)

    def record_goodput(self, clock: Mapping[str, float], process_started: str) -> None:
        """The attempt's raw goodput record (`perdure.runners.goodput`), taken now: its `goodput` is derived
        (provisionally: the lost part is settled when the attempt ends, then again when the next one starts)."""
        with self._lock:
            attempt = self.current_attempt  # an attempt already ended keeps the goodput its end settled
            if attempt is not None and attempt.get("status") == "running" and clock_is_valid(clock):
                attempt["process_started"] = process_started
                attempt["goodput_clock"] = _plain(dict(clock))
                reached = int(clock["step"])
                self._settle_goodput(attempt, reached_step=reached, kept_step=int(clock["committed_step"]),
                                     ended=float(clock["at"]))  # fmt: skip

    def _settle_goodput(
        self, attempt: dict[str, Any], *, reached_step: int, kept_step: int, ended: float | None = None
    ) -> None:
        """Derive `attempt`'s goodput from its raw record: it ended at `ended` (default: its `ended` stamp) having
        trained to `reached_step`, of which the steps up to `kept_step` were kept."""
        clock = attempt.get("goodput_clock")
        if not clock_is_valid(clock):
            return
        if ended is None:
            ended = parse_stamp(str(attempt.get("ended")))
        if ended is None:
            ended = float(clock["at"])
        attempt["goodput"] = attempt_goodput(clock, ended=ended, reached_step=reached_step, kept_step=kept_step)

    def record_save_failure(self, name: str, error: str) -> None:
        """A checkpoint save of this attempt failed: kept in the attempt so `perdure runs show` tells it."""
        with self._lock:
            attempt = self.current_attempt
            if attempt is not None:
                attempt.setdefault("save_failures", []).append({"checkpoint": name, "error": error, "at": utc_stamp()})

    def finish_attempt(self, status: str, exit_reason: str) -> None:
        """End the current attempt with `status` (one of `STATUSES` but `running`) and a human `exit_reason`."""
        if status not in STATUSES or status == "running":
            raise PerdureError(f"sidecar status {status!r}: finish an attempt with one of {', '.join(STATUSES[1:])}")
        with self._lock:
            attempt = self.current_attempt
            if attempt is None:
                raise PerdureError("finish_attempt called before start_attempt: no attempt to finish")
            ended = time.time()
            attempt.update(ended=utc_stamp(ended), status=status, exit_reason=exit_reason)
            clock = attempt.get("goodput_clock")
            if clock_is_valid(clock):
                self._settle_goodput(attempt, reached_step=int(attempt.get("last_step") or clock["step"]),
                                     kept_step=int(clock["committed_step"]), ended=ended)  # fmt: skip
            self._data["status"] = status

    def mark_stuck(self, reason: str) -> None:
        """The run refuses to train (`perdure.resilience.crash_loop`): status `stuck`, `reason` saying why. An attempt
        still marked running never recorded its end: it becomes `interrupted`, as `start_attempt` would record it."""
        with self._lock:
            self._end_unrecorded(self.current_attempt)
            self._data["status"] = "stuck"
            self._data["stuck_reason"] = reason

    def _end_unrecorded(self, attempt: dict[str, Any] | None) -> None:
        """An attempt still marked running when another launch holds the run never recorded its end: `interrupted`,
        ended at its last heartbeat."""
        if attempt is not None and attempt.get("status") == "running":
            heartbeat = heartbeat_mtime(self.run_dir)
            beat = ranks_last_beat(self.run_dir, str(attempt.get("started")))
            if beat is not None:  # the ranks' heartbeats are rewritten every few seconds, the run's less often
                heartbeat = max(heartbeat or beat, beat)
            attempt["status"] = INTERRUPTED
            attempt["exit_reason"] = "ended without recording an exit (killed or crashed)"
            attempt["ended"] = utc_stamp(heartbeat) if heartbeat is not None else None

    # ---- views and persistence ---------------------------------------------------------------------------------

    @property
    def current_attempt(self) -> dict[str, Any] | None:
        """The last attempt entry (the one `record` updates), or None before `start_attempt`."""
        attempts = self._data["attempts"]
        return attempts[-1] if attempts else None

    @property
    def status(self) -> str | None:
        return self._data["status"]

    def to_dict(self) -> dict[str, Any]:
        """A deep copy of the sidecar as plain JSON-ready data (non-finite floats already null)."""
        with self._lock:
            return json.loads(_dumps(self._data))

    def write(self, durable: bool = True) -> None:
        """Replace `sidecar.json` atomically (stamping `updated`), then touch the heartbeat. `durable=False` skips
        the fsyncs: the replace alone survives a killed process, and the sidecar is only a summary (checkpoints
        and the end of an attempt write it durably)."""
        with self._lock:
            self._data["updated"] = utc_stamp()
            self._data["goodput"] = run_goodput(self._data["attempts"], lambda stamp: parse_stamp(str(stamp)))
            text = _dumps(self._data, indent=2) + "\n"
            ensure_dir(self.run_dir)
            data = text.encode("utf-8")
            atomic_write(self.path, lambda file: file.write(data), durable=durable)
        touch_heartbeat(self.run_dir)


def read_sidecar(path: Path) -> dict[str, Any]:
    """Parse and check a `sidecar.json`; raises `SidecarError` (path and reason) if unreadable or invalid."""
    path = Path(path)
    try:
        data = read_json(path, limit=MAX_SIDECAR_BYTES)
    except FileNotFoundError:
        raise SidecarError(path, "file missing") from None
    except OSError as error:
        raise SidecarError(path, f"unreadable: {error}") from None
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError, nested too deeply
        raise SidecarError(path, f"not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise SidecarError(path, f"top level is a {type(data).__name__}, not an object")
    if data.get("format") != SIDECAR_FORMAT:
        raise SidecarError(path, f"format is {safe_name(data.get('format'))}, expected {SIDECAR_FORMAT!r}")
    expected = {"run_id": str, "config_id": str, "attempts": list, "summary": dict, "tags": list, "hparams": dict}
    for key, kind in expected.items():
        if not isinstance(data.get(key), kind):
            raise SidecarError(path, f"'{key}' is missing or not a {kind.__name__}")
    if data.get("status") is not None and data["status"] not in STATUSES:
        raise SidecarError(path, f"unknown status {safe_name(data['status'])}")
    if problem := _type_problem(data):
        raise SidecarError(path, problem)
    return data


MAX_SIDECAR_BYTES = 32 << 20
_TEXT, _COUNT, _NUMBER = (str, type(None)), "count", "number"
_FIELDS = {
    **dict.fromkeys(("lineage", "code_id", "path", "created", "updated"), _TEXT),
    **dict.fromkeys(("latest_checkpoint", "best_checkpoint"), _TEXT),
    "step": _COUNT,
    "epoch": _COUNT,
}
_ATTEMPT_FIELDS = {
    **dict.fromkeys(("started", "ended", "exit_reason", "status", "resumed_from", "process_started"), _TEXT),
    **dict.fromkeys(("resumed_step", "last_step", "steps_done", "steps_lost"), _COUNT),
    "save_seconds": _NUMBER,
}


def _wrong(value: Any, kind: Any) -> bool:
    if kind == _COUNT:
        return value is not None and (isinstance(value, bool) or not isinstance(value, int))
    if kind == _NUMBER:
        return value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)))
    return not isinstance(value, kind)


def _type_problem(data: dict[str, Any]) -> str | None:
    """What in a parsed sidecar has the wrong type for perdure's readers (the runner, the registry, `runs show`)."""
    for key, kind in _FIELDS.items():
        if _wrong(data.get(key), kind):
            return f"'{key}' has the wrong type ({type(data[key]).__name__})"
    if not all(isinstance(tag, str) for tag in data["tags"]):
        return "'tags' holds a non-string"
    for metric, entry in data["summary"].items():
        if not isinstance(entry, dict) or any(_wrong(entry.get(stat), _NUMBER) for stat in _STATS):
            return f"summary entry {safe_name(metric)} is not an object of numbers"
    if data.get("goodput") is not None and not is_goodput(data["goodput"]):
        return "'goodput' is not {fraction, seconds: {part: number}}"
    for attempt in data["attempts"]:
        if not isinstance(attempt, dict):
            return "an attempt is not an object"
        if attempt.get("goodput") is not None and not is_goodput(attempt["goodput"]):
            return "attempt field 'goodput' is not {fraction, seconds: {part: number}}"
        for key, kind in _ATTEMPT_FIELDS.items():
            if _wrong(attempt.get(key), kind):
                return f"attempt field '{key}' has the wrong type ({type(attempt[key]).__name__})"
        counts = attempt.get("restart_counts") or {}
        if not isinstance(counts, dict) or any(_wrong(value, _COUNT) for value in counts.values()):
            return "attempt field 'restart_counts' is not an object of counts"
        failures = attempt.get("save_failures") or []
        if not isinstance(failures, list) or not all(
            isinstance(f, dict) and isinstance(f.get("checkpoint"), str) and isinstance(f.get("error"), str)
            for f in failures
        ):
            return "attempt field 'save_failures' is not a list of {checkpoint, error}"
    return None


def effective_status(
    sidecar: Mapping[str, Any], heartbeat_mtime: float | None, *, now: float | None = None, stale_after: float = 600.0
) -> str:
    """The status to show: the sidecar's, except `stale` for a `running` run whose heartbeat is older than
    `stale_after` seconds (without a heartbeat, the sidecar's `updated` stamp stands in for it)."""
    status = sidecar.get("status") or "unknown"
    if status != "running":
        return status
    alive = heartbeat_mtime if heartbeat_mtime is not None else parse_stamp(str(sidecar.get("updated")))
    if alive is None:
        return status
    now = time.time() if now is None else now
    return STALE if now - alive > stale_after else status


# ---------------------------------------------------------------------- JSON helpers


def _finite(value: Any) -> float | None:
    """`value` as a float, None when not finite. Accepts tensors / numpy scalars (anything `float()` takes)."""
    number = float(value)
    return number if math.isfinite(number) else None


def _plain(value: Any) -> Any:
    """Plain JSON-ready data: mappings to dicts, sequences to lists, non-finite floats to None."""
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def _dumps(data: Any, indent: int | None = None) -> str:
    """Strict JSON (`allow_nan=False`); non-finite floats become null, unknown objects their `str`."""
    return json.dumps(_plain(data), indent=indent, allow_nan=False, default=str)
