"""Replica-group wiring on disk: the lock each group holds on the shared run, and each group's rank-local state.

All the groups of one fault-tolerant job share one run directory:

    run.lock                      held *shared* by every live group (and exclusively by anything else that writes the
                                  run: a plain launch, `perdure ckpt prune`), so those are refused while a group lives
    replica-00001.lock            held exclusively by the live group 1: a second launch of the same replica id is
                                  refused, other ids are welcome; its holder info names the process
    checkpoints/ckpt-s…           full checkpoints, committed by one group (the lowest replica id in the quorum)
    replicas/replica-00001/ckpt-s…  group 1's rank-local state at that position (RNGs, data position), one
                                  `rank{r:05d}.pth` per group-local rank, committed by group 1 through the same protocol

A restarted group restores the full checkpoint, then its own rank-local state at the same position (else it seeds
its random streams from (seed, rank, step), as a resume on more ranks does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from perdure.checkpoints.base import CheckpointPolicy, Stateful
from perdure.checkpoints.commit import verify_checkpoint
from perdure.checkpoints.file import FileCheckpointManager
from perdure.checkpoints.resolve import CheckpointInfo
from perdure.errors import CheckpointCorruptError, CheckpointSaveError
from perdure.resilience.run_lock import RunLock, RunLockedError
from perdure.safe_io import is_symlink

logger = logging.getLogger("perdure")

REPLICAS_DIR = "replicas"
SHARED_WAIT_S = 30.0  # another group may hold `run.lock` exclusively for a moment while it repairs the checkpoints


def replica_name(replica_id: int) -> str:
    """`replica-00001`: the name of a group's lock file (with `.lock`) and of its state directory."""
    return f"replica-{replica_id:05d}"


class ReplicaRunningError(RunLockedError):
    """The same replica id of this run is already training (a second launch of one group)."""

    def __init__(self, error: RunLockedError, replica_id: int) -> None:
        super().__init__(error.run_dir, error.holder, error.processes)
        self.replica_id = replica_id
        who = f"pid {self.pid} on {self.host}" if self.pid is not None else "a process this host cannot identify"
        stop = f"`kill {self.pid}`" if self.pid is not None and error.processes else "stop it"
        self.args = (
            f"replica group {replica_id} of run {self.run_dir} is already training ({who}): a second launch of the "
            f"same ft.replica_id is refused. Launch another replica id, or stop that one first ({stop}).",
        )

    def __str__(self) -> str:
        return str(self.args[0])


class ReplicaRunLock:
    """The locks one replica group holds on its run: its own `replica-<id>.lock` (exclusive) and `run.lock` (shared).

    Has the interface the attempt lifecycle uses of a `RunLock` (`acquire`, `announce`, `release`, `held`), plus
    `alone()`, the moment to repair the shared checkpoints directory. `run.lock` keeps its meaning for everything
    else: a single-process run holds it exclusively, so a plain launch and a replica group of the same run exclude
    each other.
    """

    def __init__(self, run_dir: Path, replica_id: int) -> None:
        self.run_dir = Path(run_dir)
        self.replica_id = replica_id
        self.own = RunLock(self.run_dir, f"{replica_name(replica_id)}.lock")
        self.run = RunLock(self.run_dir, shared=True)

    @property
    def held(self) -> bool:
        return self.own.held

    def acquire(self, timeout: float = 0.0, announce: bool = True) -> None:
        """Take this group's lock (refused at once when the same replica id lives) and share the run's lock."""
        try:
            self.own.acquire(timeout, announce=False)
        except RunLockedError as error:
            raise ReplicaRunningError(error, self.replica_id) from None
        try:
            self.run.acquire(timeout=max(timeout, SHARED_WAIT_S))
        except RunLockedError:
            self.own.release()
            raise
        if announce:
            self.own.announce()

    def announce(self) -> None:
        self.own.announce()

    def release(self) -> None:
        try:
            self.run.release()
        finally:
            self.own.release()

    @contextmanager
    def alone(self) -> Iterator[bool]:
        """Yields whether no other process holds the run (no other replica group lives). While True, `run.lock` is
        held exclusively; afterwards it is shared again (waiting up to `SHARED_WAIT_S` for another group's repair)."""
        self.run.release()
        exclusive = RunLock(self.run_dir)
        try:
            exclusive.acquire(announce=False)
            alone = True
        except RunLockedError:
            alone = False
        try:
            yield alone
        finally:
            if alone:
                exclusive.release()
            self.run = RunLock(self.run_dir, shared=True)
            self.run.acquire(timeout=SHARED_WAIT_S)

    def __repr__(self) -> str:
        return f"ReplicaRunLock({str(self.run_dir)!r}, replica {self.replica_id}, held={self.held})"


class ReplicaStates:
    """One group's rank-local state (RNGs, data position) per checkpoint position, in `replicas/replica-<id>/`.

    A `FileCheckpointManager` of that directory: the same commit protocol, manifest, pointers and retention as the
    full checkpoints (`keep_latest_k`), synchronous (the files are a few kilobytes). Only this group writes there, under
    its own replica lock.
    """

    def __init__(
        self,
        run_dir: Path,
        replica_id: int,
        policy: CheckpointPolicy,
        *,
        rank: int,
        world_size: int,
        identity: Mapping[str, Any],
        timeout_s: float,
    ) -> None:
        self.replica_id = replica_id
        self.root = Path(run_dir) / REPLICAS_DIR / replica_name(replica_id)
        self.manager = FileCheckpointManager(
            self.root,
            replace(policy, async_mode="disabled"),
            rank=rank,
            world_size=world_size,
            identity={**identity, "ft_replica": replica_id},
            timeout_s=timeout_s,
        )

    def save(self, name: str, local_states: Mapping[str, Stateful], meta: Mapping[str, Any]) -> bool:
        """Commit this rank's local state at position `name`; False (with a warning) when the save failed."""
        try:
            self.manager.save(name, {}, local_states, meta=dict(meta), persistent=True)
        except CheckpointSaveError as error:
            logger.warning(
                "replica group %d: its rank-local state at %s was not saved (%s); a resume from %s would seed its "
                "random streams from (seed, rank, step) instead",
                self.replica_id,
                name,
                error,
                name,
            )
            return False
        return True

    def load(self, name: str, local_states: Mapping[str, Stateful]) -> bool:
        """Restore this rank's local state saved at position `name`; False when there is none that verifies."""
        path = self.root / name
        if any(is_symlink(link) for link in (self.root.parent, self.root, path)) or not path.is_dir():
            return False  # a symlink is nothing this group wrote: never followed
        try:
            manifest = verify_checkpoint(path)
        except CheckpointCorruptError as error:
            logger.warning("replica group %d: %s; its random streams are seeded instead", self.replica_id, error)
            return False
        return self.manager.load(CheckpointInfo(path, name, manifest), {}, local_states)

    def repair(self) -> None:
        """When the attempt begins (rank 0, holding the replica lock): what an interrupted save left is quarantined."""
        self.manager.resolve()
        self.manager.repair()

    def close(self) -> None:
        self.manager.close()
