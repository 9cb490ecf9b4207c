"""The attempt: which run a runner belongs to, and the moment it starts writing into it.

    __init__      rank 0 decides the run dir and the restore source, reading only (`Attempt.decide`); an existing run
                  is locked quietly so a second launch of a live run fails at once; every rank gets the decision
                  (`Attempt.agree_on_run`)
    train()       begins the attempt (`Attempt.begin`): lock announced, bad checkpoints repaired, directories, log
                  file, metadata and the sidecar's attempt; the attempt's stamp is shared by every rank
    close()       releases the lock and the log file (`Attempt.release`)
    a failed setup  (`Attempt.record_failed_setup`) is recorded as an attempt that failed, so it shows in
                  `perdure runs ls`

Only `train()` writes: a runner built to look at a run (`from_checkpoint`, `evaluate`, `infer`, `close`) changes
nothing on disk.

`Attempt` is the component the runner owns (`runner.attempt`), built in `BaseRunner.__init__` with what it reads,
passed explicitly; what it needs of the runner later is passed to the call that needs it. `AttemptHooks` holds the
attempt's override points with their defaults (`BaseRunner` inherits them): `new_run_lock`, `repair_checkpoints`
and `attempt_details`, what a TorchFT replica group changes (a lock per replica id beside a shared `run.lock`, a
repair only while no other group lives, its replica id in the record).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from perdure.checkpoints.save_errors import free_bytes, human_bytes, what_failed
from perdure.checkpoints.source import RestoreSource, choose_restore_source
from perdure.distributed.collectives import broadcast_object
from perdure.errors import ConfigError, PerdureError, RunStuckError, WeightsMisfitError, WorkspaceError
from perdure.loggers.console import EarlyRecords, attach_log_file, detach_log_file
from perdure.resilience.crash_loop import STUCK_EXIT, is_retry, refuse_if_stuck
from perdure.resilience.hang_watch import HangVerdict
from perdure.resilience.run_lock import LOCK_NAME, AttemptLock, RunLock, RunLockedError
from perdure.runners.fields import RunnerFields
from perdure.workspace.identity import canonical_config
from perdure.workspace.launch import record_launch
from perdure.workspace.run_dir import RunDir, resolve_run_dir
from perdure.workspace.siblings import sibling_runs
from perdure.workspace.sidecar import Sidecar

if TYPE_CHECKING:
    from perdure.checkpoints.base import CheckpointManager
    from perdure.checkpoints.resolve import CheckpointInfo
    from perdure.config import RunnerConfig
    from perdure.runners.telemetry import RunTelemetry


class AttemptHooks(RunnerFields):
    """The attempt's override points, with their defaults: `BaseRunner` inherits them; the TorchFT layer
    (`perdure.ft.runner.FaultTolerant`) overrides them. They hold no state; the `Attempt` calls them. Below them, the
    runner's calls into its attempt: `_begin_attempt` (`train()`), `_release` (`close()`), `_setup_failed`
    (`RunnerMeta`)."""

    attempt: Attempt  # built by `BaseRunner.__init__`

    def new_run_lock(self, run_dir: RunDir) -> AttemptLock:
        """Rank 0, deciding or opening the run: the lock this process holds while it may write `run_dir` (not yet
        acquired). Default: the run's exclusive `run.lock`. A TorchFT replica group returns its per-replica lock
        (`perdure.ft.replica.ReplicaRunLock`). Must not touch the disk."""
        return RunLock(run_dir.path)

    def repair_checkpoints(self, lock: AttemptLock) -> None:
        """Rank 0, holding `lock` (the one `new_run_lock` made), when the attempt begins: quarantine what `resolve`
        found bad, fix pointers. A TorchFT replica group repairs the shared checkpoints only while no other group
        lives. Must not write anything else."""
        self.checkpoints.repair()

    def attempt_details(self) -> dict[str, Any]:
        """Rank 0, when the attempt begins (or its failed setup is recorded): what the attempt's record says about
        this process beyond its progress: the code it runs, its topology. Must not change any state."""
        details: dict[str, Any] = {"code_id": self.run_dir.running_code_id, "world_size": self.world_size}
        if self.run_dir.launch is not None:
            details["launch"] = self.run_dir.launch.key
        if is_retry():
            details["retry"] = True  # `perdure sweep retry`: attempts without progress are counted from here
        if self.topology_change is not None:
            details["topology_change"] = self.topology_change
        return details

    # ---- the runner's side of the attempt: begun by `train()`, released by `close()`, a failed setup recorded -----

    def _begin_attempt(self) -> None:
        """The start of `train()`: the attempt begins (`Attempt.begin`: rank 0 takes the lock, repairs, creates the
        directories, opens the log file and records the attempt; every rank gets its stamp), then the checkpoint
        manager names its staging dirs by the stamp and the hang watch starts. A disk that cannot take the first
        writes stops every rank here, before any training it could not checkpoint; what was opened is closed and the
        lock released."""
        self.state.attempt += 1
        try:
            started = self.attempt.begin(self.telemetry)
        except BaseException:
            self.telemetry.abandon()
            self._release()
            raise
        self.checkpoints.token = started
        self.hang_watch.start(started, on_hang=self.attempt.record_hang)

    def _release(self) -> None:
        """The end of the attempt on this process (`close()`, a failed start or setup): the hang watch stops, the
        attempt releases its log file and lock."""
        self.hang_watch.stop()
        self.attempt.release()

    def _setup_failed(self, error: Exception) -> None:
        """A setup (`__init__` / `__post_init__`) raised after the run was decided: record a failed attempt with the
        error (run dir, sidecar, log file), so the failure shows in `perdure runs ls`; then release everything.
        Runners built by `from_checkpoint` (to look at a run) record nothing, nor does a `ConfigError` (bad input,
        refused before anything is written: e.g. a model the parallel stack cannot split as configured; `--pretrained`
        weights that do not fit the model). Never masks `error`. Called by `RunnerMeta`."""
        if "telemetry" not in self.__dict__:  # the run was not decided: nothing to record, nothing held
            if "attempt" in self.__dict__:
                self.logger.removeHandler(self.attempt.early_records)
            return
        if isinstance(error, ConfigError) or (
            isinstance(error, WeightsMisfitError) and self.restore_source.kind == "pretrained"
        ):  # bad input: `--pretrained` weights of another architecture (a new run: there was no checkpoint)
            self._release()
            return
        try:
            if self.is_main_process and not self.inspection:
                self.attempt.record_failed_setup(f"{type(error).__name__}: {error}", self.telemetry)
        except Exception as failure:  # noqa: BLE001 - the setup's own error is what the user must see
            self.logger.warning("could not record the failed setup in %s: %s", self.run_dir.path, failure)
        finally:
            self._release()


class Attempt:
    """Deciding the run (reading only), beginning the attempt when training starts, recording a failed setup; see
    the module docstring."""

    def __init__(
        self,
        hooks: AttemptHooks,
        *,
        config: RunnerConfig,
        runner_name: str,
        rank: int,
        inspection: bool,
        early_records: EarlyRecords,
        logger: logging.Logger,
    ) -> None:
        self.hooks = hooks
        self.config = config
        self.runner_name = runner_name  # the runner class's name, part of a run's identity
        self.rank = rank
        self.is_main_process = rank == 0
        self.inspection = inspection  # built by `from_checkpoint`: a setup failure then records nothing
        self.early_records = early_records  # what is logged before the log file exists (installed on `logger`)
        self.logger = logger
        self.run_dir: RunDir  # the decided run, from `agree_on_run` (rank 0: from `decide`)
        self.restore_source: RestoreSource  # from `agree_on_run`
        self.checkpoints: CheckpointManager | None = None  # rank 0: the run's manager, made by `decide`
        self.lock: AttemptLock | None = None  # rank 0: an existing run's from `decide`, a new one's from `begin`
        self.started: str | None = None  # the attempt's UTC stamp, set when `begin` (or a failed setup) opens it
        self.log_file: logging.Handler | None = None  # the attempt's log file, from `begin` to `release`
        self.telemetry: RunTelemetry | None = None  # the records `begin` started, for a hang's verdict

    # ---- the run: decided in `__init__`, reading only -------------------------------------------------------------

    def agree(self, decision: tuple[str, Any]) -> Any:
        """Share rank 0's ("ok", value) or ("error", exception): every rank returns the value or raises the error."""
        shared = decision
        if decision[0] == "error" and isinstance(decision[1], RunStuckError):
            shared = ("stuck", str(decision[1]))  # rank 0 said why: every rank exits 93, "do not requeue"
        elif decision[0] == "error":  # exceptions travel as text: not every one pickles
            shared = ("error", f"{type(decision[1]).__name__} on rank 0: {decision[1]}")
        outcome, value = broadcast_object(shared)
        if outcome == "stuck":
            raise SystemExit(STUCK_EXIT)
        if outcome == "error":
            raise decision[1] if self.is_main_process else PerdureError(value)
        return value

    def agree_on_run(self, decision: tuple[str, Any]) -> tuple[RunDir, RestoreSource]:
        """Every rank: rank 0's decision (`decide`; the others pass ("", None)), or its error raised."""
        self.run_dir, self.restore_source = self.agree(decision)
        return self.run_dir, self.restore_source

    def decide(
        self,
        *,
        checkpoint_manager: Callable[[RunDir], CheckpointManager],
        check_same_config: Callable[[CheckpointInfo], None],
        read_pretrained: Callable[[Path], Any],
    ) -> tuple[str, Any]:
        """Rank 0: which run dir, its checkpoints resolved (reading only) by the manager `checkpoint_manager` makes
        for it, the restore source (a checkpoint's config checked by `check_same_config`, `--pretrained` weights
        read by `read_pretrained`, so unreadable ones are refused before anything is written).

        Returns ("ok", (run_dir, source)) or ("error", the exception), to be broadcast (`agree_on_run`). Nothing is
        written (but the `stuck` status of a run in a crash loop): the run lock, the repair of bad checkpoints and the
        directories come when `train()` begins the attempt.
        """
        try:
            run_dir = resolve_run_dir(self.config, self.runner_name)
            self.run_dir = run_dir
            if not self.inspection and (run_dir.path / LOCK_NAME).is_file():
                # An existing run is locked at once, so a second launch of a live run fails before building anything;
                # quietly (no holder info written): a runner built only to look at the run changes no byte of it.
                self.lock = self.hooks.new_run_lock(run_dir)
                try:
                    self.lock.acquire(announce=False)
                except RunLockedError as error:
                    if run_dir.unfinished is None:
                        raise
                    raise PerdureError(
                        f"{error}. This launch found no checkpoint under its own code's name and continues that "
                        f"unfinished run of code {run_dir.code_id}: to start a separate run beside it, rerun with "
                        "--workspace.continue_unfinished false"
                    ) from None
            checkpoints = self.checkpoints = checkpoint_manager(run_dir)
            source = choose_restore_source(
                checkpoints.resolve(),
                run_dir=run_dir.path,
                resume=self.config.resume,
                checkpoint=self.config.checkpoint,
                pretrained=self.config.pretrained,
                quarantined=checkpoints.quarantined,
            )
            if source.info is not None:
                check_same_config(source.info)
            if source.kind == "pretrained":
                assert source.path is not None  # a pretrained source carries its weights' path
                read_pretrained(source.path)  # unreadable weights are refused before anything is written
            if self.lock is not None:  # an existing run: refused when its last attempts made no progress
                refuse_if_stuck(
                    run_dir.path,
                    limit=self.config.resilience.max_attempts_without_progress,
                    resume_step=(source.info.global_step or 0) if source.info is not None else 0,
                    logger=self.logger,
                    open_sidecar=self._run_sidecar,
                )
            self._announce_run(run_dir, source)
            return "ok", (run_dir, source)
        except Exception as error:
            self.release_lock()
            return "error", error

    def _announce_run(self, run_dir: RunDir, source: RestoreSource) -> None:
        """Say where a restarted launch continues, and which runs a fresh start could have continued instead."""
        if run_dir.continued_launch:
            assert run_dir.launch is not None  # found through the launch index: a restart of that launch
            self.logger.info("restart %d of launch %s: continuing %s, the run its first attempt started",
                             run_dir.launch.restart, run_dir.launch.key, run_dir.path)  # fmt: skip
        elif run_dir.launch is not None and run_dir.launch.is_restart:
            self.logger.warning(
                "this is restart %d of launch %s, but the workspace's launch index has no entry for it (its first "
                "attempt stopped before training started?): using %s, named by the current code",
                run_dir.launch.restart,
                run_dir.launch.key,
                run_dir.path,
            )
        if run_dir.unfinished is not None:
            self.logger.warning(
                "no checkpoint of this config under this code's name: continuing the run %s, status %s, with this "
                "code %s (recorded on the attempt, diff included). To start a separate run instead, rerun with "
                "--workspace.continue_unfinished false",
                run_dir.unfinished.describe(), run_dir.unfinished.status, run_dir.running_code_id,
            )  # fmt: skip
        if source.kind == "resume" or run_dir.root is None:
            return
        siblings = sibling_runs(
            run_dir.root,
            lineage=run_dir.lineage,
            config_id=run_dir.config_id,
            workspace_id=self.config.lookup("workspace.id"),
            exclude=run_dir.path,
        )
        for sibling in siblings:
            self.logger.warning(
                "a run with the same lineage and config was trained by other code: %s. This start is a new run in %s "
                "(code %s). To continue that run instead, rerun with --workspace.code_id %s",
                sibling.describe(),
                run_dir.path,
                run_dir.code_id,
                sibling.code_id,
            )

    def _run_sidecar(self) -> Sidecar:
        """Rank 0, holding the run lock: the run's sidecar as it is on disk (to mark it before any attempt begins)."""
        run_dir = self.run_dir
        return Sidecar(run_dir.path, run_id=run_dir.run_id, lineage=run_dir.lineage, code_id=run_dir.code_id,
                       config_id=run_dir.config_id, hparams=canonical_config(self.config),
                       tags=list(self.config.workspace.tags))  # fmt: skip

    # ---- the attempt: begun by `train()`, released by `close()` ----------------------------------------------------

    def release(self) -> None:
        """Stop collecting early records, close the log file and release the run lock (the runner's `_release`)."""
        self.logger.removeHandler(self.early_records)
        detach_log_file(self.log_file)
        self.log_file = None
        self.release_lock()

    def release_lock(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def begin(self, telemetry: RunTelemetry) -> str:
        """Start writing: rank 0 takes the run lock, repairs what the resolve found, creates the directories, opens the
        log file and records the attempt in `telemetry` (metadata, sidecar, loggers); every rank returns the attempt's
        stamp, which rank 0 shares.

        A disk that cannot take these first writes (full, read-only, gone) raises on every rank (a `WorkspaceError`
        naming the file, the cause and what is free); the runner then closes what was opened and releases the lock.
        Nothing committed is touched."""
        self.telemetry = telemetry
        started: str = self.agree(self._open_attempt(telemetry) if self.is_main_process else ("", None))
        self.started = started
        self.logger.removeHandler(self.early_records)
        return started

    def record_hang(self, verdict: HangVerdict) -> None:
        """On the hang watch's thread, before this rank exits `hung`: rank 0 ends the attempt's record with the
        verdict's line; when rank 0 itself is the stopped one (it cannot), the rank that reported the hang does."""
        telemetry = self.telemetry
        assert telemetry is not None  # the watch starts once `begin` has the attempt's stamp
        if self.is_main_process:
            telemetry.record_hang(verdict.line)
        elif verdict.reporter == self.rank and 0 in verdict.frozen:
            assert self.started is not None  # the watch starts once the attempt has its stamp
            telemetry.record_hang_for(self.started, verdict.line)

    def _open_attempt(self, telemetry: RunTelemetry) -> tuple[str, Any]:
        """Rank 0: open the run (`_open_run`), then the attempt's log file and records; returns ("ok", the attempt's
        stamp) or ("error", exception), to be broadcast. An I/O failure becomes a `WorkspaceError` saying what to do."""
        outcome, value = self._open_run()
        if outcome == "ok":
            try:
                self.log_file = attach_log_file(self.run_dir.logs / f"{value}.log")
                self.early_records.replay_into(self.log_file)
                resumed = self.restore_source
                telemetry.start(
                    attempt=value,
                    resumed_from=str(resumed.info.path) if resumed.info is not None else None,
                    details=self.hooks.attempt_details(),
                )
            except Exception as error:
                outcome, value = "error", error
        if outcome == "error" and isinstance(value, OSError) and not isinstance(value, PerdureError):
            value = WorkspaceError(self._cannot_begin(value))  # UnsafeFileError (a PerdureError) says it already
        return outcome, value

    def _cannot_begin(self, error: OSError) -> str:
        free = free_bytes(self.run_dir.path)
        has = f"; {human_bytes(free)} free on that filesystem" if free is not None else ""
        return (
            f"cannot begin the attempt in {self.run_dir.path}: {what_failed(error, self.run_dir.path)}{has}. Free "
            "space there (or point --workspace.root at another disk) and rerun the same command; every committed "
            "checkpoint is untouched"
        )

    def _open_run(self) -> tuple[str, Any]:
        """Rank 0: lock, repair, create; returns ("ok", attempt stamp) or ("error", exception), to be broadcast."""
        try:
            self.run_dir.create_path()  # a root that cannot hold the run is named before the lock's own mkdir
            if self.lock is None:
                self.lock = self.hooks.new_run_lock(self.run_dir)
                self.lock.acquire()
            self.lock.announce()
            self.hooks.repair_checkpoints(self.lock)
            self.run_dir.create()
            record_launch(self.run_dir)
            return "ok", datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        except Exception as error:
            self.release_lock()
            return "error", error

    def record_failed_setup(self, reason: str, telemetry: RunTelemetry) -> None:
        """Rank 0, a setup that raised after the run was decided (the runner's `_setup_failed`): open the run and
        record a failed attempt with `reason` in `telemetry` (run dir, sidecar, log file)."""
        outcome, value = self._open_run()
        if outcome != "ok":
            self.logger.warning("the failed setup is not recorded in %s: %s", self.run_dir.path, value)
            return
        started: str = value
        self.started = started
        self.log_file = attach_log_file(self.run_dir.logs / f"{started}.log")
        self.early_records.replay_into(self.log_file)
        self.logger.removeHandler(self.early_records)
        self.logger.error("setup of run %s failed: %s", self.run_dir.path, reason)
        telemetry.record_failed_setup(attempt=started, reason=reason, details=self.hooks.attempt_details(),
                                      source=self.restore_source.info)  # fmt: skip
