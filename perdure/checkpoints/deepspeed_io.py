"""The engine's file I/O while perdure's DeepSpeed backend drives it: every write recorded, every read restricted.

DeepSpeed reads and writes its checkpoint files through `engine.checkpoint_engine`. perdure installs `RecordingIO`
there: a write creates the file (never overwriting), fsyncs it and records its size and checksum while writing (the
manifest's record, `commit.write_file`); a read is `load_deepspeed_file`, `torch.load(weights_only=True)` with only
DeepSpeed's own record classes allowed, so no checkpoint handed to the engine can run code. Imports DeepSpeed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from perdure.checkpoints.commit import FileRecord, write_file
from perdure.checkpoints.file import _save
from perdure.checkpoints.safe_unpickle import load_deepspeed_file
from perdure.safe_io import ensure_dir


class RecordingIO(CheckpointEngine):
    """A DeepSpeed CheckpointEngine: checksummed, fsynced, never-overwriting writes; allow-listed reads."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "perdure"
        self.written: dict[Path, FileRecord] = {}

    def create(self, info: CheckpointCommitInfo) -> None:
        self.written = {}

    def save(self, state_dict: Any, path: str) -> None:
        self.written[Path(path)] = write_file(Path(path), lambda file: _save(state_dict, file))

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_deepspeed_file(Path(path))  # on the CPU: DeepSpeed moves what it loads where it belongs

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        ensure_dir(path)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True  # perdure commits the whole checkpoint directory (commit.py), DeepSpeed's files among them

    def take_records(self, root: Path) -> dict[str, FileRecord]:
        """Every file written since the save began, keyed by its path relative to `root`."""
        records = {path.relative_to(root).as_posix(): record for path, record in self.written.items()}
        self.written = {}
        return records


def recording_io(engine: Any) -> RecordingIO:
    """The engine's `RecordingIO`, installed in place of DeepSpeed's own checkpoint engine on first use."""
    if not isinstance(engine.checkpoint_engine, RecordingIO):
        engine.checkpoint_engine = RecordingIO()
    return engine.checkpoint_engine
