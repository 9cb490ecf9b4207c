"""FaultTolerant: the layer that makes a stack's runner one replica group of a TorchFT job.

`Runner` adds it in front of the stack when `ft.enabled` (a TorchRunner: one process, or DDP inside the group). It
plugs into the stack's override points and copies nothing of the loop:

    data_parallel_rank   the train sampler spans (replica groups x group-local ranks): groups read different batches
    begin_step           a quorum each step; a group that joins behind heals from a live peer, then re-reads its
                         window at the position it healed to
    commit_step          gradients averaged across the participating groups through the manager, then the groups'
                         vote (`should_commit`): an uncommitted step drops its gradients, its batches are read again
    save_checkpoint      full checkpoints from the lowest replica id in the quorum (the one commit protocol); every
                         group's rank-local state (RNGs, data position) under replicas/replica-<id>/
    restore              the full checkpoint, then this group's own rank-local state at the same position
    new_run_lock         the attempt's hooks (runners/attempt.py `AttemptHooks`): a lock per replica id beside a
    repair_checkpoints   shared run.lock; the shared checkpoints are repaired only while no other group lives; the
    attempt_details      replica id and the number of groups in the attempt's record

The parallel stack (FSDP2 inside each group) uses the same layer as HSDP across groups: the averager reduces each
rank's local gradient shards with the same rank of the other groups, and a heal moves local shards (see manager.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from perdure.checkpoints.base import CheckpointPolicy, Stateful
from perdure.checkpoints.commit import CHECKPOINT_PATTERN, read_pointer
from perdure.checkpoints.resolve import CheckpointInfo
from perdure.checkpoints.source import RestoreSource
from perdure.distributed.collectives import broadcast_object
from perdure.distributed.process_group import select_backend
from perdure.errors import PerdureError
from perdure.ft.config import lighthouse_address
from perdure.ft.kill_watch import KillWatch, killed_line
from perdure.ft.manager import (
    GradientAverager,
    HealRefusedError,
    ManagerSettings,
    QuorumError,
    build_manager,
    local_shards,
    sharded_like,
    torchft_replica_id,
)
from perdure.ft.replica import ReplicaRunLock, ReplicaStates
from perdure.ft.telemetry import ReplicaTelemetry
from perdure.resilience.run_lock import AttemptLock
from perdure.runners.attempt import AttemptHooks
from perdure.runners.checkpoint_binding import CheckpointBinding
from perdure.runners.rng import derived_seed, seed_everything
from perdure.workspace.run_dir import RunDir

WAIT_FOR_GROUPS_S = 0.5  # pause before retrying a step that lacked ft.min_replica_size groups


class FTProgress:
    """The replicated progress of the job as the groups agree on it: the manager's step (commits) and batches, the
    group-steps that were missing from a commit, and the number of groups; saved with every full checkpoint and sent
    with every heal."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.step = 0
        self.batches_committed = 0
        self.missing_group_steps = 0
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "batches_committed": self.batches_committed,
            "missing_group_steps": self.missing_group_steps,
            "group_size": self.group_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.batches_committed = int(state["batches_committed"])
        self.missing_group_steps = int(state.get("missing_group_steps", 0))
        self.restored = dict(state)


class FaultTolerant(AttemptHooks):
    """Mixed in front of a stack (`class X(UserRunner, FaultTolerant, TorchRunner)`); see the module docstring. What
    it uses of the stack is declared by `RunnerFields` (perdure/runners/fields.py), the root of every runner class,
    through its base `AttemptHooks` (the attempt's override points it overrides): the stack comes after this layer in
    the runner's MRO."""

    telemetry: ReplicaTelemetry  # replaces the stack's in `__init__`
    checkpointing: CheckpointBinding  # the stack's (`BaseRunner.__post_init__`)

    def __init__(self, config: Any) -> None:
        # Read before the stack's __init__, which decides the run and takes this group's lock.
        self.replica_id: int = config.ft.replica_id
        self.group_size: int = config.ft.group_size
        super().__init__(config)
        self.ft_progress = FTProgress(self.group_size)
        self.ft_manager: Any = None
        self._kill_watch: KillWatch | None = None
        self._rearms_at_commit = 2  # the first commit follows the first all-reduce; the second, a whole step
        self._ft_store: Any = None
        self._averager: GradientAverager | None = None
        self._quorum_open = False  # a quorum was taken for the coming step (a healed group re-reads its window)
        self._healed = False
        self._quorum_view: tuple[int, int | None] | None = None  # (participants, this group's rank) of the last quorum
        self._reporter = False  # the lowest replica id in the quorum: commits full checkpoints, reports the run
        self._replica_saved: tuple[int, int, int] | None = None
        self._uncommitted_in_row = 0
        self.checkpoints.identity["ft_replica"] = self.replica_id  # which group's rank-local files a checkpoint has
        loggers = self.telemetry.loggers.loggers  # the base's, from `metric_loggers()`, not opened yet
        self.telemetry = ReplicaTelemetry(
            self.run_dir, config, self.state, loggers, active=self.is_main_process, replica_id=self.replica_id
        )
        self.replica_states = ReplicaStates(
            self.run_dir.path,
            self.replica_id,
            CheckpointPolicy.from_config(config.ckpt),
            rank=self.rank,
            world_size=self.world_size,
            identity=self.checkpoints.identity,
            timeout_s=config.dist.timeout,
        )

    # ---- data and state --------------------------------------------------------------------------------------

    def data_parallel_rank(self) -> tuple[int, int]:
        shard, shards = self.data_shard()
        return self.replica_id * shards + shard, self.group_size * shards

    def build_dataloaders(self) -> None:
        super().build_dataloaders()
        if self.dataloaders["train"].is_iterable:
            raise PerdureError(
                "ft.enabled needs a map-style train dataset (with __len__ and __getitem__): a replica group's data "
                "position is a global sample offset, which a group that heals from a peer continues from; an "
                "IterableDataset's position cannot move to a peer's"
            )

    def extra_states(self) -> dict[str, Stateful]:
        return {**super().extra_states(), "ft": self.ft_progress}

    def restore(self, source: RestoreSource) -> None:
        """The full checkpoint, then this group's own rank-local state saved at the same position."""
        super().restore(source)
        if source.kind not in ("resume", "checkpoint"):
            return
        info = source.info
        assert info is not None  # a resume or checkpoint source carries its checkpoint
        restored = self.ft_progress.restored or {}
        if restored.get("group_size") not in (None, self.group_size):
            self.logger.warning(
                "TOPOLOGY CHANGE: %s was trained by %s replica groups, this job has %d (ft.group_size): the data is "
                "sharded over the new number of groups from the same global sample offset",
                info.name,
                restored["group_size"],
                self.group_size,
            )
        self._replica_saved = (self.state.global_step, self.state.epoch, self.state.samples_in_epoch)
        if self.replica_states.load(info.name, self.checkpoint_local_states()):
            return
        if info.manifest.get("ft_replica", 0) == self.replica_id:
            return  # the checkpoint's own rank files are this group's (it committed it, or it is a plain run's)
        stream = self.random_stream()
        seed = derived_seed(self.config.seed, stream, self.state.global_step)
        seed_everything(seed)
        self.logger.warning(
            "replica group %d has no rank-local state saved at %s (another group committed it): its random streams "
            "are seeded from (seed, rank %d, step %d) = %d",
            self.replica_id,
            info.name,
            stream,
            self.state.global_step,
            seed,
        )

    # ---- the step ------------------------------------------------------------------------------------------------

    def begin_step(self) -> bool:
        """A quorum for the coming step. False after a heal: the state (position included) is now the peer's, and
        the loop re-reads its window from there; the quorum stays open for that window."""
        if self._quorum_open:
            return super().begin_step()
        manager = self.ft_manager if self.ft_manager is not None else self._start_ft()
        self.checkpoints.wait_for_snapshots()  # a heal rewrites what an async snapshot may still be copying
        before, started = self.state.global_step, time.perf_counter()
        self._healed = False
        try:
            manager.start_quorum()
        except Exception as error:
            raise QuorumError(
                f"replica group {self.replica_id} got no quorum from the lighthouse at {self._lighthouse()} within "
                f"ft.quorum_timeout={self.config.ft.quorum_timeout}s ({type(error).__name__}: {error}). Is the "
                "lighthouse still running, and are at least its --min-replicas groups alive? Relaunch this group "
                "once it is: it resumes from the latest committed checkpoint, or heals from a live group"
            ) from None
        self._quorum_open = True
        failure = manager.errored()
        if failure is not None and isinstance(failure.original_exception, HealRefusedError):
            raise failure.original_exception
        changed = self._note_quorum(manager.num_participants(), manager.participating_rank())
        if changed and self._catch_up():
            return False
        if self._healed:
            seconds = time.perf_counter() - started
            self.logger.info(
                "replica group %d healed from a live group in %.2fs: step %d -> %d (epoch %d, sample %d)",
                self.replica_id,
                seconds,
                before,
                self.state.global_step,
                self.state.epoch,
                self.state.samples_in_epoch,
            )
            self.telemetry.healed(from_step=before, to_step=self.state.global_step, seconds=seconds, source="peer")
            return False
        return super().begin_step()

    def commit_step(self) -> bool:
        """Average the gradients across the participating groups, then the groups' vote on this step."""
        manager = self.ft_manager
        assert self._averager is not None  # made by `_start_ft`, in the `begin_step` before
        self._averager.average(manager)
        committed = bool(manager.should_commit())
        self._quorum_open = False
        self.telemetry.step_outcome(committed)
        participants = manager.num_participants()
        if committed:
            if self._kill_watch is not None and self._rearms_at_commit:  # ... and of what the first steps build
                self._rearms_at_commit -= 1
                self._kill_watch.rearm()
            self._uncommitted_in_row = 0
            self.ft_progress.step = manager.current_step()
            self.ft_progress.batches_committed = manager.batches_committed()
            self.ft_progress.missing_group_steps += max(self.group_size - participants, 0)
            return super().commit_step()
        self._uncommitted_in_row += 1
        error = manager.errored()
        why = f"{type(error.original_exception).__name__}" if error is not None else "a group voted against it"
        if participants < self.config.ft.min_replica_size:
            why = f"{participants} group(s) take part, ft.min_replica_size is {self.config.ft.min_replica_size}"
            time.sleep(WAIT_FOR_GROUPS_S)
        if self._uncommitted_in_row in (1, 10, 100) or self._uncommitted_in_row % 1000 == 0:
            self.logger.warning(
                "replica group %d: step %d did not commit (%s; %d in a row): its gradients are dropped and its "
                "batches are read again",
                self.replica_id,
                self.state.global_step + 1,
                why,
                self._uncommitted_in_row,
            )
        return False

    def _note_quorum(self, participants: int, rank: int | None) -> bool:
        """Record the quorum; True when it changed (who takes part, or this group's rank in it)."""
        view = (participants, rank)
        changed = view != self._quorum_view
        if changed:
            self._quorum_view = view
            self.logger.info(
                "replica group %d: quorum of %d group(s) at step %d, this group is rank %s of it",
                self.replica_id,
                participants,
                self.state.global_step,
                rank,
            )
            self.telemetry.quorum_changed(step=self.state.global_step, participants=participants, rank=rank)
        self._reporter = rank == 0
        self.telemetry.set_reporting(self._reporter)
        return changed

    def _catch_up(self) -> bool:
        """At a quorum change: when the run's latest committed checkpoint is ahead of this group (a group that has
        died since trained further than every live one), continue from it, as a relaunch would. Every group of the
        quorum is at the same step by now (the ones behind healed), so all of them take the same checkpoint."""
        info = self._newer_checkpoint() if self.is_main_process else None
        if self.world_size > 1:
            info = broadcast_object(info)  # the group's ranks must load together (DCP is collective)
        if info is None:
            return False
        before, started = self.state.global_step, time.perf_counter()
        self.restore(RestoreSource("resume", info=info))
        self.ft_manager.load_state_dict(
            {"step": self.ft_progress.step, "batches_committed": self.ft_progress.batches_committed}
        )
        self.logger.warning(
            "replica group %d: the run's latest checkpoint %s (step %d) is ahead of this group and its quorum (step "
            "%d): continuing from it",
            self.replica_id,
            info.name,
            self.state.global_step,
            before,
        )
        seconds = time.perf_counter() - started
        self.telemetry.healed(from_step=before, to_step=self.state.global_step, seconds=seconds, source=info.name)
        return True

    def _newer_checkpoint(self) -> CheckpointInfo | None:
        """Rank 0: the run's newest verified checkpoint when it is ahead of this group's step, else None."""
        match = CHECKPOINT_PATTERN.match(read_pointer(self.run_dir.checkpoints, "latest") or "")
        if match is not None and match["step"] is not None and int(match["step"]) <= self.state.global_step:
            return None  # the usual case, decided without reading a manifest
        info = self.checkpoints.resolve()
        if info is None or not isinstance(info.global_step, int) or info.global_step <= self.state.global_step:
            return None
        return info

    # ---- the manager ---------------------------------------------------------------------------------------------

    def _lighthouse(self) -> str:
        address = lighthouse_address(self.config.ft.lighthouse)
        assert address is not None  # `check_ft` refused a config without one
        return address

    def _start_ft(self) -> Any:
        """Join the job when the first step begins (never while building the runner): the manager, its servers."""
        ft = self.config.ft
        assert self.attempt.started is not None  # `train()` began the attempt before its first step
        self.replica_states.manager.token = self.attempt.started
        settings = ManagerSettings(
            replica_id=self.replica_id,
            group_rank=self.rank,
            group_world_size=self.world_size,
            lighthouse=self._lighthouse(),
            min_replica_size=ft.min_replica_size,
            timeout_s=float(ft.timeout),
            quorum_timeout_s=float(ft.quorum_timeout),
            heartbeat_interval_s=float(ft.heartbeat_interval),
            # dist.backend, as inside the group: auto is NCCL on CUDA; gloo also carries CUDA tensors (several groups
            # on one GPU, which NCCL refuses)
            backend=select_backend(self.config.dist.backend) if self.device.type == "cuda" else "gloo",
        )
        if self.rank == 0:  # the process that runs the group's manager server, which torchft's kill ends
            self._kill_watch = KillWatch(self._stopped_from_outside).arm()
        self.ft_manager, self._ft_store = build_manager(settings, self._ft_state_dict, self._ft_load_state_dict)
        if self._kill_watch is not None:  # ahead of the exit handlers of what the manager's start built
            self._kill_watch.rearm()
        progress = self.ft_progress
        if progress.restored is None:  # a fresh start, or a checkpoint of a plain run: one commit per step taken
            progress.step = self.state.global_step + self.state.skipped_steps
        self.ft_manager.load_state_dict({"step": progress.step, "batches_committed": progress.batches_committed})
        assert self.optimizer is not None  # the stack built it before training
        parameters = [p for group in self.optimizer.param_groups for p in group["params"]]
        self._averager = GradientAverager(parameters)
        self.logger.info(
            "replica group %d of %d (%d rank%s each) joins the lighthouse at %s at step %d",
            self.replica_id,
            self.group_size,
            self.world_size,
            "" if self.world_size == 1 else "s",
            self._lighthouse(),
            self.state.global_step,
        )
        return self.ft_manager

    def _ft_state_dict(self) -> dict[str, Any]:
        """What a healing peer receives: everything a full checkpoint holds, copied now, sharded state as this rank's
        shards (see `local_shards`)."""
        return local_shards({key: state.state_dict() for key, state in self.checkpoint_states().items()})

    def _ft_load_state_dict(self, states: dict[str, Any]) -> None:
        """Heal: take a live peer's state, in the restore order of a checkpoint; shards go back into this rank's
        sharded layout (the peer's rank of the same index holds the same shards)."""
        for key, state in self.checkpoint_states().items():
            if key in states:
                state.load_state_dict(sharded_like(state.state_dict(), states[key]))
        self._healed = True

    def _stopped_from_outside(self) -> None:
        """The kill watch's action (on its thread; the process exits 94 right after): say it, record `killed`."""
        line = killed_line(self.replica_id, self._lighthouse(), torchft_replica_id(self.replica_id))
        self.logger.error("%s", line)
        self.telemetry.record_hang(line, status="killed")

    def _stop_ft(self) -> None:
        if self._kill_watch is not None:
            self._kill_watch.disarm()
        if self.ft_manager is not None:
            manager, self.ft_manager = self.ft_manager, None
            manager.shutdown(wait=False)
        self._ft_store = None

    # ---- checkpoints, lock, records ---------------------------------------------------------------------------------

    def save_checkpoint(self, reason: str) -> Any:
        """Every group saves its rank-local state; the reporting group (lowest replica id in the quorum) commits the
        full checkpoint."""
        position = (self.state.global_step, self.state.epoch, self.state.samples_in_epoch)
        if self.config.ckpt.enabled and self.state.global_step > 0 and position != self._replica_saved:
            meta = {"global_step": position[0], "epoch": position[1], "samples_in_epoch": position[2], "reason": reason}
            if self.replica_states.save(self.checkpointing.position_name(), self.checkpoint_local_states(), meta):
                self._replica_saved = position
        return super().save_checkpoint(reason) if self._reporter else None

    def export_model(self) -> Any:
        return super().export_model() if self._reporter else None

    def export_hf(self, target: str | Path | None = None) -> Path | None:
        # one group writes <run dir>/hf, as for model.pth: two groups renaming their staging directories into the
        # same place would race
        return super().export_hf(target) if self._reporter else None

    def close(self, status: str = "stopped", reason: str = "closed") -> None:
        try:
            self._stop_ft()
            self.replica_states.close()
        finally:
            super().close(status, reason)

    def new_run_lock(self, run_dir: RunDir) -> ReplicaRunLock:
        return ReplicaRunLock(run_dir.path, self.replica_id)

    def repair_checkpoints(self, lock: AttemptLock) -> None:
        assert isinstance(lock, ReplicaRunLock)  # the attempt took the one `new_run_lock` made
        with lock.alone() as alone:
            if alone:
                # Resolved again: a group that died meanwhile may have committed since this runner restored; the
                # first quorum then continues from that checkpoint (`_catch_up`).
                self.checkpoints.resolve()
                super().repair_checkpoints(lock)
            else:
                self.logger.info(
                    "replica group %d: other groups of run %s are alive; the shared checkpoints are repaired by the "
                    "next group that starts alone",
                    self.replica_id,
                    self.run_dir.path,
                )
        self.replica_states.repair()

    def attempt_details(self) -> dict[str, Any]:
        return {**super().attempt_details(), "replica": self.replica_id, "ft_group_size": self.group_size}
