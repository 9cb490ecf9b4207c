"""How the ranks of one save meet in its staging directory, through files rather than collectives.

Every rank writes its share into the same staging directory, then a small marker naming each file it wrote with its
size and checksum (or the error that stopped it). Rank 0 waits for every marker, removes them, and commits with the
one protocol of `commit.py`. Files, not collectives, so a background writer thread or process can take part, and a
rank that dies makes rank 0's save fail after the timeout instead of hanging it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from perdure.atomic import atomic_write
from perdure.checkpoints.commit import FileRecord
from perdure.errors import CheckpointSaveError
from perdure.safe_io import read_json

MARKER_PREFIX = ".records-rank"


def _marker(staging: Path, rank: int) -> Path:
    return staging / f"{MARKER_PREFIX}{rank:05d}.json"


def publish_records(staging: Path, rank: int, files: dict[str, FileRecord] | None, error: str | None = None) -> None:
    """This rank is done with `staging`: what it wrote (or why it could not)."""
    payload = {
        "rank": rank,
        "error": error,
        "files": {name: {"size": r.size, "digest": r.digest} for name, r in (files or {}).items()},
    }
    data = json.dumps(payload).encode("utf-8")
    atomic_write(_marker(staging, rank), lambda file: file.write(data))


def gather_records(staging: Path, world_size: int, timeout_s: float, poll_s: float = 0.01) -> dict[str, FileRecord]:
    """Rank 0: wait for every rank's marker, then return all records and remove the markers.

    Raises CheckpointSaveError naming the rank when one reported an error or did not report within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    markers = [_marker(staging, rank) for rank in range(world_size)]
    while not all(marker.exists() for marker in markers):
        if time.monotonic() > deadline:
            missing = [rank for rank, marker in enumerate(markers) if not marker.exists()]
            raise CheckpointSaveError(
                f"ranks {missing} did not finish writing {staging.name} within {timeout_s:.0f}s (dist.timeout)"
            )
        time.sleep(poll_s)
    files: dict[str, FileRecord] = {}
    for rank, marker in enumerate(markers):
        payload = _read_marker(marker, rank)
        if payload["error"]:
            raise CheckpointSaveError(f"rank {rank} could not write its share: {payload['error']}")
        files.update({name: FileRecord(r["size"], r["digest"]) for name, r in payload["files"].items()})
    for marker in markers:
        marker.unlink()
    return files


def _read_marker(marker: Path, rank: int) -> dict:
    """A rank's marker, bounded and type-checked like any file in a run directory."""
    try:
        payload = read_json(marker, limit=MAX_MARKER_BYTES, max_depth=4)
    except (OSError, ValueError) as error:
        raise CheckpointSaveError(f"rank {rank}'s record {marker.name} is unreadable: {error}") from None
    files = payload.get("files") if isinstance(payload, dict) else None
    ok = (
        isinstance(files, dict)
        and isinstance(payload.get("error"), (str, type(None)))
        and all(
            isinstance(r, dict) and type(r.get("size")) is int and isinstance(r.get("digest"), str)
            for r in files.values()
        )
    )
    if not ok:
        raise CheckpointSaveError(f"rank {rank}'s record {marker.name} is malformed")
    return payload


MAX_MARKER_BYTES = 16 << 20
