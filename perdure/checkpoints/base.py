"""The CheckpointManager contract every backend (file, DCP, DeepSpeed engine) implements, and its policy."""

from __future__ import annotations

import contextlib
import logging
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from perdure.checkpoints.async_save import AsyncSaver, SaveJob, SaveOutcome
from perdure.checkpoints.commit import (
    QUARANTINE_DIR,
    STAGING_PREFIX,
    FileRecord,
    commit_checkpoint,
    make_staging_dir,
    read_pointer,
    write_file,
    write_pointer,
)
from perdure.checkpoints.gather import gather_records, publish_records
from perdure.checkpoints.mirror_restore import restore_newest
from perdure.checkpoints.mirror_upload import MirrorFailure, MirrorUploader
from perdure.checkpoints.read import StateReader, checkpoint_format
from perdure.checkpoints.resolve import CheckpointInfo, Resolution, committed_checkpoints, find_latest, report
from perdure.checkpoints.resolve import repair as repair_checkpoints
from perdure.checkpoints.retire import leftovers, remove_leftover, retire
from perdure.checkpoints.save_errors import human_bytes, save_failure
from perdure.checkpoints.save_watch import SaveWatch
from perdure.checkpoints.snapshot import Snapshot, available_memory, local_part, snapshot_nbytes
from perdure.distributed.collectives import all_ranks
from perdure.distributed.process_group import launched_local_world_size
from perdure.errors import CheckpointError
from perdure.safe_io import ensure_dir, is_symlink, refuse_symlinked_dir, safe_name

logger = logging.getLogger("perdure")

# An async snapshot may use at most this share of the host memory still available; otherwise the save is synchronous.
MEMORY_HEADROOM = 0.8


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CheckpointPolicy:
    """When to write and what to keep; read from the `ckpt.*` config section."""

    enabled: bool = True
    async_mode: str = "disabled"
    device_staging: str = "auto"
    hang_warning_s: float = 300.0
    interval: int | None = None
    interval_steps: int | None = None
    keep_latest_k: int = 0
    save_best: bool = True
    export_dtype: str | None = None

    @classmethod
    def from_config(cls, ckpt: Mapping[str, Any]) -> CheckpointPolicy:
        return cls(
            enabled=bool(ckpt.get("enabled", True)),
            async_mode=ckpt.get("async_mode") or "disabled",
            device_staging=ckpt.get("device_staging") or "auto",
            hang_warning_s=float(ckpt.get("hang_warning_s", 300.0)),
            interval=ckpt.get("interval"),
            interval_steps=ckpt.get("interval_steps"),
            keep_latest_k=int(ckpt.get("keep_latest_k") or 0),
            save_best=bool(ckpt.get("save_best", True)),
            export_dtype=ckpt.get("export_dtype"),
        )


def snapshot_buffer_sets(needed: int, room: float, pinned: bool) -> int:
    """How many snapshots' worth of host buffers to make ahead of the saves: two when they are pinned (pinning is what
    costs, and a second set lets a save find buffers while the writer still holds the previous save's), else one
    (a pageable buffer costs a page fault per page, once: the same as the copy into a fresh one); fewer when `room`
    bytes cannot hold them."""
    wanted = 2 if pinned else 1
    return next((sets for sets in range(wanted, 0, -1) if sets * needed <= room), 0)


class CheckpointManager(ABC):
    """Owns one run's `checkpoints/` directory: resolve what to resume from, save, load, prune.

    The runner hands over *what* to save as two mappings of objects with `state_dict` / `load_state_dict`:
    `states` (replicated: identical on every rank; the mapping order is the restore order) and `local_states`
    (rank-local: RNG, data position). A backend decides only the bytes inside a checkpoint directory (`write`,
    `read`); the commit protocol (staging, fsync, manifest last, rename, pointers) and retention live here and in
    `commit.py`, so every backend commits the same way. A `collective` backend is entered by every rank for save and
    load; a non-collective one is called by every rank too, and writes rank-local files on each rank.
    """

    backend: ClassVar[str]
    collective: ClassVar[bool] = False

    def __init__(
        self,
        root: Path,
        policy: CheckpointPolicy,
        *,
        rank: int = 0,
        world_size: int = 1,
        identity: Mapping[str, Any] | None = None,
        token: str = "",
        timeout_s: float = 600.0,
    ) -> None:
        self.root = Path(root)
        self.token = token
        self.timeout_s = timeout_s
        self.policy = policy
        self.rank = rank
        self.world_size = world_size
        self.identity = dict(identity or {})
        self.resumed_from: str | None = None
        self.last_saved: str | None = None
        self._saver: AsyncSaver | None = None
        self.watch = SaveWatch(self.root, policy.hang_warning_s)  # names a save that writes nothing for a while
        self._saves = 0
        self.quarantined: list[str] = []
        self.resolution: Resolution | None = None  # what `resolve` found, for `repair`
        self.mirror: MirrorUploader | None = None  # `ckpt.mirror`, on rank 0 of a training runner (mirror_upload.py)

    # ---- what the runner calls -------------------------------------------------------------------------------

    def resolve(self) -> CheckpointInfo | None:
        """The newest checkpoint of this run that verifies. Reads only (but for a checkpoint of the mirror newer than
        any here, which is downloaded and committed like a save): what is wrong (bad checkpoints, staging leftovers,
        pointers) is reported now and fixed by `repair` when training starts."""
        refuse_symlinked_dir(self.root)  # the repair and every save write here: never through a symlink
        if not self.root.is_dir() and self.mirror is None:
            return None
        self.resolution = find_latest(self.root)
        if self.mirror is not None:  # the newest checkpoint that verifies in either tier (mirror.py)
            chosen = self.resolution.chosen
            local = (chosen.global_step or -1, chosen.name) if chosen is not None else None
            if restore_newest(self.mirror.store, self.root, local):
                self.resolution = find_latest(self.root)
        fate = "left in place (moved to quarantine when training starts)" if self.policy.enabled else "skipped"
        report(self.resolution, logger.warning, default_fate=fate)
        quarantine_dir = self.root / QUARANTINE_DIR
        real = quarantine_dir.is_dir() and not is_symlink(quarantine_dir)
        self.quarantined = sorted(path.name for path in quarantine_dir.iterdir()) if real else []
        self.quarantined += [path.name for path, _ in self.resolution.failures]
        return self.resolution.chosen

    def repair(self) -> None:
        """Rank 0, holding the run lock, when training starts: quarantine what `resolve` found bad and fix pointers.

        Refuses (CheckpointError) when a checkpoint was committed since `resolve` (another process trained this run
        meanwhile): the state this runner restored is then not the run's newest.
        """
        resolution = self.resolution
        if resolution is None or self.rank != 0 or not self.policy.enabled:
            return
        known = {path.name for path, _ in resolution.failures}
        chosen = resolution.chosen.name if resolution.chosen is not None else None
        for path in committed_checkpoints(self.root):
            if path.name == chosen:
                break
            if path.name not in known:
                raise CheckpointError(
                    f"{path} was committed after this runner restored {chosen or 'nothing'} (another process trained "
                    "this run meanwhile); build the runner again to continue from the newest checkpoint"
                )
        if resolution.needs_repair:
            fates = repair_checkpoints(resolution, logger.warning)
            for path, fate in fates.items():
                logger.warning("CHECKPOINT REPAIR: %s %s", path, fate)
        self.resolution = None

    def save(
        self,
        name: str,
        states: Mapping[str, Stateful],
        local_states: Mapping[str, Stateful],
        *,
        meta: Mapping[str, Any],
        is_best: bool = False,
        texts: Mapping[str, str] | None = None,
        persistent: bool = False,
        deferred: Iterable[torch.Tensor] = (),
    ) -> Path | None:
        """Save checkpoint `name`; returns its directory (committed in sync mode, queued in async mode) or None.

        `meta` goes into the manifest (step, epoch, ids, ...); `texts` are small human-readable files (config.yaml).
        `persistent` saves (best, final, preemption) are never coalesced away in async mode. `deferred` tensors are
        ones only the optimizer step changes: an async snapshot copies them while training goes on, and the runner
        calls `wait_for_snapshots()` before its next optimizer step. A name that is already committed is not written
        again: a position is never saved twice. A failed sync save raises after removing its partial directory.
        """
        if not self.policy.enabled:
            return None
        final = self.root / name
        if final.exists():
            return final
        try:
            replicated, local = self.snapshot_states(states, local_states)
        except Exception as error:
            raise save_failure(error, name=name, root=self.root) from error
        self._saves += 1
        job = SaveJob(
            name=name,
            replicated=replicated,
            local=local,
            meta={**self.identity, **meta, "backend": self.backend, "world_size": self.world_size, "states": [*states]},
            is_best=is_best,
            texts=dict(texts or {}),
            persistent=persistent,
            protected=frozenset() if self.resumed_from is None else frozenset({self.resumed_from}),
            sequence=self._saves,
            nbytes=snapshot_nbytes([replicated, local]),
        )
        if self.policy.async_mode == "disabled":
            self._commit_now(job)
            return final
        saver = self._async_saver()
        if (report := saver.pool.take_report()) is not None:
            logger.log(*report)
        # With several ranks a queued save is dropped only when every rank drops it: ranks must commit the same saves.
        saver.make_room(agree=all_ranks if self.world_size > 1 else None)
        # Buffers the pool holds already (reserved ahead, or given back by the last save) need no memory now.
        needed = max(0, snapshot_nbytes([job.replicated, job.local]) - saver.pool.idle_nbytes())
        available = available_memory()
        if needed > MEMORY_HEADROOM * available:
            logger.warning(
                "saving %s synchronously: its snapshot needs %.2f GB but only %.2f GB of host memory is available",
                name,
                needed / 1e9,
                available / 1e9,
            )
            saver.drain()
            self._commit_now(job)
            return final
        try:
            snapshot = Snapshot(job.replicated, job.local, deferred=deferred, pool=saver.pool)
        except Exception as error:
            raise save_failure(error, name=name, root=self.root) from error
        job.replicated, job.local = {}, {}
        saver.submit(job, snapshot)
        return final

    def reserve_snapshot_buffers(self, tensors: Iterable[torch.Tensor]) -> None:
        """Start making, on a background thread, the host buffers that async snapshots of `tensors` (the model's state
        and what the optimizer step changes: nearly all of a checkpoint's bytes) copy into, so that no save pays for
        allocating (and on a GPU, pinning) them in the training loop. Returns at once; does nothing unless saves are
        async. Called by the runner once per attempt, after its first optimizer step (which creates the optimizer's
        state). How many sets: `snapshot_buffer_sets`."""
        if not self.policy.enabled or self.policy.async_mode == "disabled":
            return
        tensors = list(tensors)
        needed = snapshot_nbytes(tensors)
        pool = self._async_saver().pool
        pinned = any(pool.staging.wants_pinned(local_part(tensor)) for tensor in tensors)
        # Every rank on this host reserves at about the same time, each seeing the same free memory: a share each.
        sharing = max(1, launched_local_world_size())
        room = MEMORY_HEADROOM * (available_memory() / sharing + pool.idle_nbytes())
        sets = snapshot_buffer_sets(needed, room, pinned)
        if sets == 0 or needed == 0:
            return
        logger.info(
            "making %d x %s of %s host buffers for async snapshots in the background",
            sets,
            human_bytes(needed),
            "pinned" if pinned else "shared" if pool.shared_memory else "pageable",
        )
        pool.reserve(tensors, sets)

    def _commit_now(self, job: SaveJob) -> None:
        """A synchronous save: any failure is raised as a `CheckpointSaveError` (I/O, with its real cause) or a
        `CheckpointStateError` (state that cannot be serialized), see `save_errors.py`."""
        self.watch.begin(job.name, "training waits for it (a synchronous save)")
        try:
            self.commit_job(job)
        except Exception as error:
            raise save_failure(error, name=job.name, root=self.root, needed=job.nbytes) from error
        finally:
            self.watch.end(job.name)

    def snapshot_states(
        self, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state dicts one save writes (replicated, local), taken in the training loop; an async save then copies
        their tensors. A backend that needs another form of an object's state (DCP's FQN-keyed model and optimizer
        state) overrides this."""
        return (
            {key: state.state_dict() for key, state in states.items()},
            {key: state.state_dict() for key, state in local_states.items()},
        )

    def commit_job(self, job: SaveJob) -> Path:
        """Write this rank's share of one save; on rank 0 also commit, publish and prune. Runs inline, in the writer
        thread or in the writer process. With several ranks they meet in one staging directory (see `gather.py`)."""
        final = self.root / job.name
        staging = self._staging_dir(job.name, job.sequence)
        try:
            try:
                files = self.write(staging, job.replicated, job.local)
                if self.rank == 0:
                    for relative, text in job.texts.items():
                        files[relative] = _write_text_file(staging / relative, text)
            except BaseException as error:
                if self.world_size > 1:
                    with contextlib.suppress(OSError):  # rank 0 may have failed too and removed the staging dir
                        publish_records(staging, self.rank, None, f"{type(error).__name__}: {error}")
                raise
            if self.world_size > 1:
                publish_records(staging, self.rank, files)
                if self.rank != 0:
                    return final
                files = gather_records(staging, self.world_size, self.timeout_s)
            commit_checkpoint(staging, final, files, job.meta)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        write_pointer(self.root, "latest", job.name)
        if job.is_best:
            write_pointer(self.root, "best", job.name)
        self.last_saved = job.name
        if self.mirror is not None:  # inline or in the writer thread; a writer process has none: see `_mirror`
            self.mirror.committed(job.name, str(job.meta.get("reason")), protected=job.protected)
        self.prune(protected=job.protected | {job.name})
        return final

    def _staging_dir(self, name: str, sequence: int = 0) -> Path:
        """A fresh staging directory; with several ranks, one whose name every rank derives alike (the attempt token
        is the same on all ranks and new for every attempt, so a killed attempt's leftovers never mix in; the save's
        sequence number is new for every save, so a retry of a failed save never meets the failed one's files)."""
        if self.world_size == 1:
            return make_staging_dir(self.root, name)
        staging = self.root / f"{STAGING_PREFIX}{name}-{self.token}-{sequence}"
        return ensure_dir(staging)  # every rank creates it; a symlink planted under its name is refused

    def discard_staging(self, job: SaveJob, writer_pid: int) -> None:
        """Rank 0: remove what `commit_job(job)` had staged in process `writer_pid` (a writer process that died while
        writing it, so its own cleanup never ran). Committed checkpoints are untouched; a symlink is not followed."""
        if self.rank != 0:
            return
        if self.world_size == 1:
            staged = list(self.root.glob(f"{STAGING_PREFIX}{job.name}-{writer_pid}-*"))
        else:
            staged = [self.root / f"{STAGING_PREFIX}{job.name}-{self.token}-{job.sequence}"]
        for path in staged:
            shutil.rmtree(path, ignore_errors=True)

    def point_best(self, name: str) -> None:
        """Point `best` at `name`, a checkpoint committed by an earlier attempt whose evaluation only this attempt
        finished (see `BaseRunner._evaluate_pending`). Rank 0 writes, when no save is in flight (the attempt has
        not saved yet); a pointer that cannot be written is reported and `best` keeps its checkpoint."""
        if self.rank != 0 or not self.policy.enabled or not (self.root / name).is_dir():
            return
        try:
            write_pointer(self.root, "best", name)
        except OSError as error:
            logger.warning("best still names %s: %s", read_pointer(self.root, "best"), error)

    def wait_for_snapshots(self) -> None:
        """Block until async snapshots have copied what the optimizer step is about to change."""
        if self._saver is not None:
            self._saver.wait_for_snapshots()

    def take_outcomes(self) -> list[SaveOutcome]:
        """Background saves finished since the last call (failures carry their error)."""
        return self._mirror(self._saver.take_outcomes()) if self._saver is not None else []

    def _mirror(self, outcomes: list[SaveOutcome]) -> list[SaveOutcome]:
        """Hand each checkpoint a writer process committed to the mirror's uploader (it returns at once; one already
        handed over by `commit_job` is not uploaded twice); return `outcomes`."""
        if self.mirror is not None:
            for outcome in outcomes:
                if outcome.error is None:
                    self.mirror.committed(outcome.name, outcome.reason, protected=(self.resumed_from,))
        return outcomes

    def mirror_failures(self) -> list[MirrorFailure]:
        """Uploads to the mirror that failed since the last call: the runner records them like failed saves."""
        return self.mirror.take_failures() if self.mirror is not None else []

    def drain(self) -> list[SaveOutcome]:
        """Wait for every queued save; return the outcomes not yet taken."""
        if self._saver is None:
            return []
        self._saver.drain()
        return self._mirror(self._saver.take_outcomes())

    def start(self) -> None:
        """Called when training starts: an async manager starts its background writer (and process) now."""
        if self.policy.enabled and self.policy.async_mode != "disabled":
            self._async_saver()

    def _async_saver(self) -> AsyncSaver:
        if self._saver is None:
            staging = self.policy.device_staging
            self._saver = AsyncSaver(self, self.policy.async_mode, device_staging=staging, watch=self.watch)
        return self._saver

    def __getstate__(self) -> dict[str, Any]:
        # The writer process gets a copy of the manager, without the queue that feeds it.
        state = dict(self.__dict__)
        state["_saver"] = None
        state["resolution"] = None
        state["watch"] = None  # the training process watches the saves
        state["mirror"] = None  # and uploads to the mirror
        return state

    def load(self, info: CheckpointInfo, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]) -> bool:
        """Restore every object from a verified checkpoint, in the mappings' order. Returns False when the checkpoint
        holds no rank-local state for this rank (it was written by fewer ranks)."""
        if self.rank == 0:
            _warn_unmatched_states(info, states)
        found = self._reader(info).read(info.path, states, local_states)
        if info.path.parent.resolve() == self.root.resolve():
            self.resumed_from = info.name
        return found

    def _reader(self, info: CheckpointInfo) -> StateReader:
        """This manager, or the manager of the backend that wrote `info`, from the read path's registry
        (`read.checkpoint_format`; a run may change `ckpt.backend`, e.g. `auto` when it resumes on another number of
        ranks). Every rank makes the same choice, from the broadcast manifest."""
        backend = info.manifest.get("backend", self.backend)
        if backend == self.backend:
            return self
        written_by = checkpoint_format(backend)
        if written_by is None or written_by.manager is None:
            raise CheckpointError(
                f"checkpoint {info.path} was written by backend {safe_name(backend)}, which this version of perdure "
                "cannot read"
            )
        logger.warning(
            "checkpoint %s was written by the %s backend but this run saves with the %s backend: reading it with the "
            "%s reader (restricted like every reader: no checkpoint can run code)",
            info.path,
            backend,
            self.backend,
            backend,
        )
        return written_by.manager(
            self.root,
            self.policy,
            rank=self.rank,
            world_size=self.world_size,
            identity=self.identity,
            token=self.token,
            timeout_s=self.timeout_s,
        )

    def prune(self, protected: frozenset[str] = frozenset()) -> list[Path]:
        """Apply `keep_latest_k` by scanning the directory, so retention survives restarts.

        Never removes the `latest` or `best` target, the checkpoint this attempt resumed from, or the one just saved.
        A directory is first renamed aside, then deleted, so a kill mid-delete never leaves a half checkpoint under a
        committed name.
        """
        if not self.policy.enabled or self.rank != 0:
            return []
        # Never fails the save that called it (that checkpoint is committed): a problem is a warning.
        for leftover in leftovers(self.root)[0]:
            try:
                remove_leftover(leftover)
            except OSError as error:
                logger.warning("could not remove %s, left by an interrupted prune: %s", leftover, error)
        keep = self.policy.keep_latest_k
        if keep <= 0:
            return []
        spared: set[str | None] = {*protected, read_pointer(self.root, "latest"), read_pointer(self.root, "best")}
        spared |= {self.resumed_from, self.last_saved}
        if self.mirror is not None:
            spared |= self.mirror.pending()  # not uploaded yet
        removed = []
        for path in committed_checkpoints(self.root)[keep:]:
            if path.name in spared:
                continue
            try:
                retire(path)
            except OSError as error:
                logger.warning("ckpt.keep_latest_k: could not remove %s (%s); every checkpoint is intact", path, error)
                continue
            removed.append(path)
        return removed

    def close(self) -> list[SaveOutcome]:
        """Wait for every save in flight and stop the background writer, then for the mirror's uploads (at most
        `ckpt.mirror_drain_s`); return the outcomes not yet taken."""
        outcomes = []
        if self._saver is not None:
            outcomes = self.drain()
            self._saver.close()
            self._saver = None
        if self.mirror is not None:
            self.mirror.close()
        return outcomes

    # ---- what a backend implements ---------------------------------------------------------------------------

    @abstractmethod
    def write(self, staging: Path, replicated: dict[str, Any], local: dict[str, Any]) -> dict[str, FileRecord]:
        """Write this rank's share of a checkpoint into `staging`; return every file written with its record.

        Called on every rank inside `save`. Must fsync what it writes (use `commit.write_file`) and must not touch
        pointers, manifests or anything outside `staging`.
        """

    @abstractmethod
    def read(self, path: Path, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]) -> bool:
        """Load a verified checkpoint directory into the given objects, in order; return whether this rank's local
        state was there. Collective backends are entered by every rank. Must not write anything."""


def _write_text_file(path: Path, text: str) -> FileRecord:
    data = text.encode()
    return write_file(path, lambda f: f.write(data))


def _warn_unmatched_states(info: CheckpointInfo, states: Mapping[str, Stateful]) -> None:
    """Say which objects a restore leaves alone: one the runner saves that the checkpoint lacks (code that saves a new
    object resumed an older checkpoint) keeps the state it was built with; one the checkpoint holds that the runner no
    longer saves is not read. A checkpoint whose manifest lists no `states` (written before it did) is not checked."""
    stored = info.manifest.get("states")
    if not isinstance(stored, list):
        return
    if missing := [key for key in states if key not in stored]:
        one = len(missing) == 1
        logger.warning(
            "checkpoint %s holds no %s: the code that wrote it did not save %s, so %s the state this run built",
            info.path,
            ", ".join(repr(key) for key in missing),
            "it" if one else "them",
            "it keeps" if one else "they keep",
        )
    if unread := [safe_name(key) for key in stored if key not in states]:
        logger.warning(
            "checkpoint %s holds %s, which this runner does not save or restore: not read", info.path, ", ".join(unread)
        )
