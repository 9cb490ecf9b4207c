"""Rank heartbeats: where each rank of a job is in the training loop, readable by the others without a collective.

Every rank keeps one small file in the run directory, `heartbeats/rank-<r>.json` (`replica-<id>-rank-<r>.json` for a
TorchFT replica group), holding a fixed-width JSON record: the attempt, the rank's host and pid, its phase (see
`PHASES`), the step that phase belongs to, since when it is in it, whether it finished a step of this attempt yet
(`armed`) and when the record was last written (`beat`). The record is rewritten in place (`pwrite` of the same
number of bytes on a descriptor kept open) by the rank's watch thread, within 50 ms of a change and every few seconds
anyway, from what the training loop last noted in memory: the loop itself never touches the disk for it.

A file and not the process group's TCPStore: a rank stopped with SIGSTOP (or frozen by a hung device) must not take
the channel down with it, and under a plain `env://` launch the store lives in rank 0's process. Reading another
rank's record is a bounded read of a regular file (no symlink followed); a record that is torn, foreign or of
another attempt reads as None.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from perdure.safe_io import ensure_dir, open_writable, read_regular

HEARTBEATS_DIR = "heartbeats"
RECORD_BYTES = 512  # every record is padded to this width, so a rewrite in place never leaves a longer old tail
MAX_HOST_CHARS = 128

# The loop's phases, in the order one step goes through them: a rank whose (step, order) is smaller is behind.
# A step S reads its batches (data_loading), computes forward, backward and the optimizer step (training_step), then
# may evaluate and save at S; a rank back from an evaluation or a save, not yet reading step S + 1's batches, is at
# end_of_step. setup (restore, the first evaluation of a resumed position) and closing (final save, drain, export)
# frame the loop.
PHASES = {
    "setup": -1,
    "data_loading": 0,
    "training_step": 1,
    "evaluation": 2,
    "checkpoint": 3,
    "end_of_step": 4,
    "closing": 5,
}
# Phases that have limits of their own (dist.timeout, ckpt.hang_warning_s), never dist.step_timeout.
EXEMPT_PHASES = frozenset({"setup", "evaluation", "checkpoint", "closing"})

logger = logging.getLogger("perdure")


@dataclass(frozen=True)
class RankBeat:
    """One rank's heartbeat record. Times are POSIX seconds of the writing host's clock."""

    attempt: str
    rank: int
    host: str
    pid: int
    phase: str
    step: int
    since: float
    beat: float
    armed: bool

    @property
    def position(self) -> tuple[int, int]:
        """How far the rank got: (step, order of its phase in the step); the smallest is the rank furthest behind."""
        return self.step, PHASES[self.phase]

    def encode(self) -> bytes:
        record = asdict(self)
        record["host"] = self.host[:MAX_HOST_CHARS]
        data = json.dumps(record, separators=(",", ":")).encode()
        return data.ljust(RECORD_BYTES - 1) + b"\n"

    @classmethod
    def decode(cls, data: bytes) -> RankBeat | None:
        """The record in `data`, or None when it is not one (torn by a concurrent rewrite, foreign, damaged)."""
        try:
            record = json.loads(data.decode("utf-8"))
        except ValueError:
            return None
        if not isinstance(record, dict) or set(record) != set(cls.__dataclass_fields__):
            return None
        texts, counts, times = ("attempt", "host", "phase"), ("rank", "pid", "step"), ("since", "beat")
        if not all(isinstance(record[key], str) for key in texts) or record["phase"] not in PHASES:
            return None
        if not all(isinstance(record[key], int) and not isinstance(record[key], bool) for key in counts):
            return None
        if not all(isinstance(record[key], (int, float)) and not isinstance(record[key], bool) for key in times):
            return None
        if not isinstance(record["armed"], bool):
            return None
        return cls(**record)


def heartbeat_path(run_dir: Path, group: str, rank: int) -> Path:
    """The heartbeat file of `rank` in `run_dir`; `group` ("" or e.g. "replica-1-") separates TorchFT groups."""
    return Path(run_dir) / HEARTBEATS_DIR / f"{group}rank-{rank}.json"


def read_beat(path: Path, attempt: str) -> RankBeat | None:
    """The record in `path` if it is one of `attempt`; None when missing, unreadable, torn or of another attempt."""
    try:
        beat = RankBeat.decode(read_regular(path, 4 * RECORD_BYTES))
    except OSError:
        return None
    return beat if beat is not None and beat.attempt == attempt else None


class HeartbeatWriter:
    """Rewrites one rank's heartbeat file in place. A write that fails (a full disk) is a warning, once: the
    heartbeat only describes the training, it never stops it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        ensure_dir(path.parent)
        self._fd = open_writable(path)
        os.ftruncate(self._fd, 0)  # an older, longer record from another version never trails the new one
        self._failed = False

    def write(self, beat: RankBeat) -> None:
        try:
            os.pwrite(self._fd, beat.encode(), 0)
        except OSError as error:
            if not self._failed:
                logger.warning("could not write %s (%s); the hang watch of this rank goes blind", self.path, error)
            self._failed = True
        else:
            self._failed = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


MAX_HEARTBEAT_FILES = 4096  # a reader of a foreign run directory looks at no more records than this


def attempt_beats(run_dir: Path, attempt: str) -> list[RankBeat]:
    """Every rank's record of `attempt` in `run_dir/heartbeats/` (those of other attempts, torn or foreign ones
    left out; at most `MAX_HEARTBEAT_FILES` files read)."""
    folder = Path(run_dir) / HEARTBEATS_DIR
    try:
        if folder.is_symlink() or not folder.is_dir():
            return []
        names = sorted(entry.name for entry in os.scandir(folder) if entry.name.endswith(".json"))
    except OSError:
        return []
    beats = (read_beat(folder / name, attempt) for name in names[:MAX_HEARTBEAT_FILES])
    return [beat for beat in beats if beat is not None]


def completed_step(beat: RankBeat) -> int:
    """The last step `beat`'s rank finished: in data_loading or training_step it was still in step `beat.step`."""
    return beat.step - 1 if beat.phase in ("data_loading", "training_step") else beat.step


def reached_step(run_dir: Path, attempt: str) -> int | None:
    """The furthest step any rank of `attempt` finished, as its heartbeat last said (None: no record). A SIGKILL
    leaves the record in place, within 50 ms of the rank's last change of step."""
    steps = [completed_step(beat) for beat in attempt_beats(run_dir, attempt)]
    return max(steps) if steps else None


def last_beat(run_dir: Path, attempt: str) -> float | None:
    """When a rank of `attempt` last wrote its heartbeat (POSIX time; None: no record): close to when it ended."""
    beats = [beat.beat for beat in attempt_beats(run_dir, attempt)]
    return max(beats) if beats else None
