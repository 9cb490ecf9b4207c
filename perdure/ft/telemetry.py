"""What the replica groups of one run report, without overwriting each other.

Every group's rank 0 records its own attempts and its own fault-tolerance record (quorum changes, heals, steps
committed or not) in the shared `sidecar.json`; each write re-reads the file under `sidecar.lock` and merges, so no
group's entries are lost. The run-wide summary (step, metrics, checkpoints) and the metric loggers (metrics.csv,
TensorBoard, W&B) belong to the *reporting* group: the one that commits the full checkpoints, i.e. the lowest replica
id in the current quorum. When the quorum changes, the reporting role moves, and the new reporter opens the loggers
at its step (which cuts what a dead reporter logged past it, as any resume does).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from perdure.config import RunnerConfig
from perdure.loggers.base import MetricLogger
from perdure.resilience.rank_heartbeat import reached_step as ranks_reached_step
from perdure.runners.state import RunnerState
from perdure.runners.telemetry import RunTelemetry
from perdure.safe_io import open_writable
from perdure.workspace.heartbeat import Heartbeat
from perdure.workspace.run_dir import RunDir
from perdure.workspace.sidecar import Sidecar, SidecarError, read_sidecar, utc_stamp

logger = logging.getLogger("perdure")

SIDECAR_LOCK = "sidecar.lock"
MAX_EVENTS = 100  # quorum changes and heals kept per group (the newest); the log files keep every one
PROGRESS_KEYS = ("step", "epoch", "summary", "latest_checkpoint", "best_checkpoint")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = open_writable(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock


def _replica_of(attempt: Mapping[str, Any]) -> int:
    """The group an attempt belongs to; an attempt of a plain launch (no `replica`) counts as group 0's."""
    replica = attempt.get("replica", 0)
    return replica if isinstance(replica, int) and not isinstance(replica, bool) else -1


class ReplicaSidecar(Sidecar):
    """The shared sidecar as one replica group writes it: its own attempts and `ft.replicas[<id>]`, merged into what
    is on disk at every write; the run-wide progress only while `reporting`."""

    def __init__(self, run_dir: Path, *, replica_id: int, group_size: int, **identity: Any) -> None:
        self.replica_id = replica_id
        self.reporting = False
        self._own: dict[str, Any] | None = None
        self._earlier_ft: Any = None
        super().__init__(run_dir, **identity)
        self.record_ft: dict[str, Any] = {"replica_id": replica_id, "quorum_changes": [], "heals": []}
        earlier = self._earlier_ft if isinstance(self._earlier_ft, dict) else {}
        listed = earlier.get("replicas")
        replicas = listed if isinstance(listed, dict) else {}
        self._data["ft"] = {"group_size": group_size, "replicas": dict(replicas)}

    def _load_earlier(self) -> dict[str, Any] | None:
        earlier = super()._load_earlier()
        self._earlier_ft = earlier.get("ft") if earlier is not None else None
        return earlier

    @property
    def current_attempt(self) -> dict[str, Any] | None:
        return self._own

    def start_attempt(self, **kwargs: Any) -> dict[str, Any]:
        """Start this group's attempt: an earlier attempt of *this group* left running is the interrupted one."""
        with self._lock:
            everyone = self._data["attempts"]
            self._data["attempts"] = [a for a in everyone if _replica_of(a) == self.replica_id]
            try:
                self._own = super().start_attempt(**kwargs)  # steps_lost: what *this group* trained (`_reached_step`)
            finally:
                others = [a for a in everyone if _replica_of(a) != self.replica_id]
                self._data["attempts"] = sorted(others + self._data["attempts"], key=lambda a: str(a.get("started")))
            self.record_ft.update(attempt=self._own["started"], steps_committed=0, steps_uncommitted=0, heals=[])
            return self._own

    def _reached_step(self, attempt: Mapping[str, Any]) -> int:
        """How far this group's previous `attempt` trained: its last record, or further as its own ranks' heartbeats
        said (the run's shared `heartbeat` is any group's)."""
        own = ranks_reached_step(self.run_dir, str(attempt.get("started"))) or 0
        return max(int(attempt.get("last_step") or 0), own)

    def write(self, durable: bool = True) -> None:
        with self._lock, _locked(self.run_dir / SIDECAR_LOCK):
            self._merge_disk()
            super().write(durable)

    def _merge_disk(self) -> None:
        try:
            disk = read_sidecar(self.path) if self.path.exists() else None
        except SidecarError as error:
            logger.warning("%s; this group rewrites it from what it knows", error)
            disk = None
        mine = [a for a in self._data["attempts"] if _replica_of(a) == self.replica_id]
        record = dict(self.record_ft, updated=utc_stamp())
        if disk is None:
            self._data["ft"]["replicas"][str(self.replica_id)] = record
            return
        others = [a for a in disk["attempts"] if isinstance(a, dict) and _replica_of(a) != self.replica_id]
        self._data["attempts"] = sorted(others + mine, key=lambda a: str(a.get("started")))
        stored = disk.get("ft")
        ft = stored if isinstance(stored, dict) else {}
        listed = ft.get("replicas")
        replicas = listed if isinstance(listed, dict) else {}
        self._data["ft"]["replicas"] = {**replicas, str(self.replica_id): record}
        if not self.reporting:
            for key in PROGRESS_KEYS:
                if key in disk:
                    self._data[key] = disk[key]
        self._data["created"] = disk.get("created") or self._data["created"]
        if any(a.get("status") == "running" for a in self._data["attempts"]):
            self._data["status"] = "running"

    def add_event(self, kind: str, event: Mapping[str, Any]) -> None:
        with self._lock:
            events = self.record_ft[kind]
            events.append({"at": utc_stamp(), **event})
            del events[:-MAX_EVENTS]

    def count(self, key: str) -> None:
        with self._lock:
            self.record_ft[key] = self.record_ft.get(key, 0) + 1


class ReplicaTelemetry(RunTelemetry):
    """RunTelemetry of one replica group: a shared sidecar, and metric loggers open only while the group reports."""

    def __init__(
        self,
        run_dir: RunDir,
        config: RunnerConfig,
        state: RunnerState,
        loggers: list[MetricLogger],
        *,
        active: bool,
        replica_id: int,
    ) -> None:
        super().__init__(run_dir, config, state, loggers, active=active)
        self.replica_id = replica_id
        self.reporting = False
        self._loggers_open = False

    @property
    def _own_sidecar(self) -> ReplicaSidecar:
        """The shared sidecar as this group writes it (what `_new_sidecar` makes), once `start` recorded the attempt."""
        assert isinstance(self.sidecar, ReplicaSidecar)
        return self.sidecar

    def _new_sidecar(self, **identity: Any) -> Sidecar:
        return ReplicaSidecar(
            self.run_dir.path, replica_id=self.replica_id, group_size=self.config.ft.group_size, **identity
        )

    def start(self, *, attempt: str, resumed_from: str | None, details: Mapping[str, Any] | None = None) -> None:
        """Record this group's attempt; the metric loggers wait until the group reports (`set_reporting`)."""
        if not self.active:
            return
        self._record_attempt(attempt, resumed_from, details or {})
        self.heartbeat = Heartbeat(self.run_dir.path, self.state.global_step)
        self._write_sidecar()

    def set_reporting(self, reporting: bool) -> None:
        """Called at every quorum: whether this group now commits the checkpoints and reports the run."""
        if not self.active or reporting == self.reporting:
            return
        self.reporting = reporting
        self._own_sidecar.reporting = reporting
        if self._loggers_open:  # files another reporter rewrote meanwhile are reopened, never appended to stale
            self.loggers.close()
            self._loggers_open = False
        if reporting:
            step = self.state.global_step
            self.loggers.open(self.run_dir.path, resumed_step=step, state=self.state, config=self.config)
            self._loggers_open = True
            self._own_sidecar.record(step=step, epoch=self.state.epoch)
        logger.info(
            "replica group %d %s the run's reporter (metrics, checkpoints) at step %d",
            self.replica_id,
            "is now" if reporting else "is no longer",
            self.state.global_step,
        )
        self._write_sidecar()

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int) -> None:
        if self.reporting:
            super().log_metrics(split, metrics, step)
        elif self.active:  # this group's own view, in its log file only
            text = " ".join(f"{name} {value:.6g}" for name, value in metrics.items())
            logger.info("step %d %s (replica group %d): %s", step, split, self.replica_id, text)

    def log_image(self, tag: str, image: Any, step: int) -> None:
        if self.reporting:
            super().log_image(tag, image, step)

    def flush(self) -> None:
        if self.reporting or not self.active:
            super().flush()
            return
        assert self.heartbeat is not None  # `start` made it
        self.heartbeat.beat(self.state.global_step)
        self._own_sidecar.record(step=self.state.global_step, epoch=self.state.epoch)  # this group's own attempt
        now = time.monotonic()
        if now - self._sidecar_at > 10.0:
            self._write_sidecar(durable=False)
            self._sidecar_at = now

    def quorum_changed(self, *, step: int, participants: int, rank: int | None) -> None:
        """The quorum this group takes part in changed: who takes part, and this group's rank in it."""
        if self.active:
            self._own_sidecar.add_event("quorum_changes", {"step": step, "participants": participants, "rank": rank})
            self._write_sidecar(durable=False)

    def healed(self, *, from_step: int, to_step: int, seconds: float, source: str) -> None:
        """This group took a newer state: from a live peer (`source="peer"`) or from a committed checkpoint."""
        if self.active:
            event = {"from_step": from_step, "to_step": to_step, "seconds": round(seconds, 3), "source": source}
            self._own_sidecar.add_event("heals", event)
            self._write_sidecar()

    def step_outcome(self, committed: bool) -> None:
        if self.active:
            self._own_sidecar.count("steps_committed" if committed else "steps_uncommitted")
