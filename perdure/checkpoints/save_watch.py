"""A watch on the saves under way: one that writes nothing for `ckpt.hang_warning_s` is named in the log.

A filesystem that hangs (an NFS or Lustre server gone, a quota daemon stuck) blocks the write of a checkpoint without
an error: a sync save stops training, an async one stops the final or preemption save from ever ending, and the job
looks alive until the scheduler kills it, without a word about why. The watch measures how many bytes each save under
way has staged (the files under `root/.tmp-<name>-*`, whichever process writes them) and logs a warning that names the
save, the directory, the bytes so far and what the run is doing meanwhile, again at doubling intervals while it lasts,
and once more when the save ends. The measurement runs on a thread of its own with a deadline: on a hung filesystem
`stat` itself hangs, and the warning must come all the same.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from perdure.checkpoints.commit import STAGING_PREFIX
from perdure.checkpoints.save_errors import human_bytes

logger = logging.getLogger("perdure")

MAX_ENTRIES = 100_000  # a staging directory holds a few files per rank; never walk more than this


def staged_bytes(root: Path, name: str) -> int:
    """Bytes of the files under the staging directories of save `name`; a symlink counts its own size, never its
    target's (none is followed)."""
    total, seen = 0, 0
    prefix = f"{STAGING_PREFIX}{name}-"
    with os.scandir(root) as entries:
        staging = [
            entry.path for entry in entries if entry.name.startswith(prefix) and entry.is_dir(follow_symlinks=False)
        ]
    for directory in staging:
        for parent, _, files in os.walk(directory):
            for file in files:
                seen += 1
                if seen > MAX_ENTRIES:
                    return total
                try:
                    stat = os.lstat(os.path.join(parent, file))
                except OSError:
                    continue
                total += stat.st_size
    return total


@dataclass
class _Save:
    name: str
    waiting: str  # what the run does while this save is written
    started: float
    progressed: float  # when its staged bytes last grew (or it began)
    staged: int = 0
    warned: int = 0  # warnings given so far
    next_warning: float = 0.0


class SaveWatch:
    """Saves under way and a daemon thread that checks them every `poll_s` seconds (started by the first `begin`).

    `measure(root, name)` gives a save's staged bytes (a seam for tests); it gets `deadline_s` to answer."""

    def __init__(
        self,
        root: Path,
        quiet_s: float,
        *,
        poll_s: float | None = None,
        deadline_s: float = 10.0,
        measure: Callable[[Path, str], int] = staged_bytes,
    ) -> None:
        self.root, self.quiet_s, self.deadline_s, self.measure = Path(root), quiet_s, deadline_s, measure
        self.poll_s = poll_s if poll_s is not None else min(30.0, max(quiet_s / 4, 0.05))
        self._saves: dict[str, _Save] = {}
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None
        self._measuring: threading.Thread | None = None  # a measurement that has not answered yet
        self.warnings: list[str] = []  # every warning given, for tests and the run's summary

    def begin(self, name: str, waiting: str) -> None:
        """A save of `name` starts writing; `waiting` says what the run does meanwhile (part of the warning)."""
        if self.quiet_s <= 0:
            return
        now = time.monotonic()
        with self._condition:
            self._saves[name] = _Save(name, waiting, now, now, next_warning=now + self.quiet_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="perdure-save-watch", daemon=True)
                self._thread.start()

    def end(self, name: str) -> None:
        """The save of `name` is over (committed or failed); one it was warned about says so."""
        with self._condition:
            save = self._saves.pop(name, None)
        if save is not None and save.warned:
            logger.warning("checkpoint %s: the write ended after %.0fs", name, time.monotonic() - save.started)

    def _run(self) -> None:
        while True:
            with self._condition:
                self._condition.wait(self.poll_s)
                saves = list(self._saves.values())
            for save in saves:
                self._check(save)

    def _check(self, save: _Save) -> None:
        staged = self._staged(save.name)
        now = time.monotonic()
        if staged is not None and staged > save.staged:
            save.staged, save.progressed = staged, now
            return
        if now - save.progressed < self.quiet_s or now < save.next_warning:
            return
        with self._condition:
            if self._saves.get(save.name) is not save:
                return  # it ended meanwhile
        answer = (
            f"{human_bytes(save.staged)} staged so far"
            if staged is not None
            else f"the filesystem did not answer a stat within {self.deadline_s:.0f}s"
        )
        message = (
            f"checkpoint {save.name} has written nothing for {now - save.progressed:.0f}s ({answer}, under "
            f"{self.root}/{STAGING_PREFIX}{save.name}-*): the filesystem may be hung or overloaded; {save.waiting}. "
            "Check it (`df`, `ls` there, the cluster's storage status); the save goes on by itself when it answers"
        )
        logger.warning(message)
        self.warnings.append(message)
        save.warned += 1
        save.next_warning = now + self.quiet_s * 2**save.warned

    def _staged(self, name: str) -> int | None:
        """The save's staged bytes, or None when the measurement did not answer within the deadline."""
        if self._measuring is not None and self._measuring.is_alive():
            return None  # the last one is still stuck: do not start another
        result: list[int] = []

        def measure() -> None:
            try:
                result.append(self.measure(self.root, name))
            except OSError:
                result.append(0)

        self._measuring = threading.Thread(target=measure, name="perdure-save-watch-stat", daemon=True)
        self._measuring.start()
        self._measuring.join(self.deadline_s)
        return result[0] if result else None
