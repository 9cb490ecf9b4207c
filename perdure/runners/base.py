"""BaseRunner: one explicit training lifecycle, readable top to bottom, and the checkpoint contract.

    MyRunner(config)        __init__: validate config, distributed, seed, which run dir, restore decision (reads only)
      └─ __post_init__      optimizer / scheduler defaults, EMA, model placement, dataloaders, restore, wrapping
    runner.train()          begin the attempt (lock, repair, directories, log file, records), then train_steps() or
                            train_epochs(): both drive the one loop in `_fit`
      └─ per window         begin_step -> forward_backward (train_step per micro-batch -> backward) ->
                            commit_step -> optimizer step -> EMA
      └─ per step / epoch   log, evaluate, score, checkpoint
      └─ at the end         final checkpoint, model export

Stack-specific work (device, autocast, gradient scaling, wrapping) lives in the subclasses' override points.

Only `train()` writes into the workspace: a runner built to look at a run (`from_checkpoint`, `evaluate`, `infer`,
`close`) changes nothing on disk. A setup that fails (an exception in `__init__` or `__post_init__` once the run is
decided) is recorded as a failed attempt, so that it shows in `perdure runs ls` with its error.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import signal
from abc import ABCMeta
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, cast

import torch
from torch import nn

from perdure.checkpoints.async_save import WRITER_PROCESS_NAME
from perdure.checkpoints.base import CheckpointManager, CheckpointPolicy, Stateful
from perdure.checkpoints.mirror_upload import mirror_for_run
from perdure.checkpoints.select import manager_class as select_manager_class
from perdure.config import RunnerConfig
from perdure.data.loader import ResumableLoader
from perdure.distributed.gloo_exit import settle_gloo_workers_at_exit
from perdure.errors import PerdureError
from perdure.loggers.console import (
    EarlyRecords,
    drop_orphaned_early_records,
    get_logger,
    record_error,
)
from perdure.resilience.hang_watch import HangWatch, watched_phase
from perdure.resilience.signals import PreemptionHandler
from perdure.runners.accumulation import AccumulationMixin
from perdure.runners.attempt import Attempt, AttemptHooks
from perdure.runners.cadence import Cadence
from perdure.runners.checkpoint_binding import NO_WEIGHTS, CheckpointBinding
from perdure.runners.checkpointing import CheckpointHooks, building_for_inspection, check_same_config
from perdure.runners.compile import uncompiled
from perdure.runners.data_setup import DataSetupMixin
from perdure.runners.determinism import configure_determinism
from perdure.runners.divergence import SkippedSteps
from perdure.runners.ema import ExponentialMovingAverage
from perdure.runners.evaluation import EvaluationHooks, EvaluationStopped, Evaluator
from perdure.runners.host_malloc import hold_malloc_thresholds
from perdure.runners.metrics import MetricsMixin
from perdure.runners.optim import build_optimizer, build_scheduler
from perdure.runners.param_coverage import check_parameter_coverage
from perdure.runners.rng import derived_seed, seed_everything
from perdure.runners.save_schedule import SaveSchedule
from perdure.runners.state import RunnerState
from perdure.runners.state_dict_check import check_state_dict_round_trip
from perdure.runners.stragglers import StragglerWatch
from perdure.runners.telemetry import RunTelemetry
from perdure.runners.throughput import ThroughputMeter
from perdure.workspace.run_dir import RunDir

NO_CONTEXT = nullcontext()  # reusable: entering it does nothing


class RunnerMeta(ABCMeta):
    """Calls `__post_init__` once, after the user's `__init__` has assigned model, optimizer and datasets; a setup
    that raises is recorded as a failed attempt of the run it was building (`_setup_failed`, runners/attempt.py)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        runner = cast(Any, cls).__new__(cls)  # the runner class's own `__new__` (a checker reads the metaclass's)
        try:
            runner.__init__(*args, **kwargs)
            runner.__post_init__()
        except Exception as error:
            runner._setup_failed(error)
            raise
        return runner


class BaseRunner(
    AttemptHooks, CheckpointHooks, EvaluationHooks, MetricsMixin, DataSetupMixin, AccumulationMixin,
    metaclass=RunnerMeta,
):  # fmt: skip
    """The training lifecycle shared by every stack. Subclass a stack (or `Runner`), not this class."""

    # None: the manager comes from `ckpt.backend` (`perdure.checkpoints.select.manager_class`: auto is DCP with several
    # ranks, else file). A class set here, on a stack or on the user's runner class, wins over the config.
    checkpoint_manager_class: ClassVar[type[CheckpointManager] | None] = None

    # Its fields (config, state, model, checkpoints, telemetry, ...) are declared, typed, in `RunnerFields`
    # (runners/fields.py), the root its parts share; `__init__` sets them.

    # ---- components, each built with what it reads, passed explicitly --------------------------------------------
    attempt: Attempt  # `__init__`: the run decided, the attempt begun, released, a failed setup (runners/attempt.py)
    evaluator: Evaluator  # `__post_init__`: evaluation loops, results and the best score (runners/evaluation.py)
    checkpointing: CheckpointBinding  # `__post_init__`: saves, their failures, the restore (checkpoint_binding.py)

    def __init__(self, config: RunnerConfig) -> None:
        if not isinstance(config, RunnerConfig):
            raise TypeError(f"{type(self).__name__} takes a RunnerConfig, got {type(config).__name__}")
        if multiprocessing.current_process().name == WRITER_PROCESS_NAME:
            raise PerdureError(
                "the training script was run again inside perdure's checkpoint writer process: ckpt.async_mode=process "
                "starts a process that imports the script, so put the training under `if __name__ == '__main__':`"
            )
        config.check()
        hold_malloc_thresholds()  # before the model and the loop allocate: no heap trimmed and regrown every step
        configure_determinism(config.deterministic)  # before anything can initialise CUDA
        self.config = config
        self.logger = get_logger()
        self.state = RunnerState()
        self.model = None  # type: ignore[assignment]  # the user's `__init__` assigns it; `__post_init__` checks
        self.criterion = None
        self.optimizer = None  # type: ignore[assignment]  # the user's `__init__` or else `__post_init__` builds it
        self.scheduler = None
        self.ema = None
        self.datasets = {}
        self.collate_fns = {}  # per split: how samples become a batch
        self.checkpointed = {}  # the user's own objects, saved after the runner's
        self.dataloaders = {}
        self.is_best = False
        self.save_failures = []
        self.preemption = PreemptionHandler()
        self.stop_signal = 0  # the signal all ranks agreed to stop for (0: none)
        self.rank, self.world_size = self.init_distributed()
        settle_gloo_workers_at_exit()  # a rank that leaves right after a collective must not abort (gloo_exit.py)
        seed_everything(config.seed)

        self.inspection = building_for_inspection()  # `from_checkpoint`: a setup failure then records nothing
        if not self.is_main_process:
            self.logger.setLevel(logging.WARNING)  # rank 0 alone reports progress
        # What is logged before the run's log file exists (it is opened when training starts) still reaches it.
        drop_orphaned_early_records()
        early_records = EarlyRecords(owner=self)
        self.logger.addHandler(early_records)
        self.attempt = Attempt(
            self,
            config=config,
            runner_name=type(self).__name__,
            rank=self.rank,
            inspection=self.inspection,
            early_records=early_records,
            logger=self.logger,
        )
        # Rank 0 decides where the run lives and what it restores from, reading only; the others follow, or fail with
        # the same message.
        decision = ("", None)
        if self.is_main_process:
            decision = self.attempt.decide(
                checkpoint_manager=self._checkpoint_manager_for,
                check_same_config=lambda info: check_same_config(config, info),
                read_pretrained=self.read_pretrained,
            )
        self.run_dir, self.restore_source = self.attempt.agree_on_run(decision)
        if self.is_main_process:
            assert self.attempt.checkpoints is not None  # `decide` made the run's manager, or the agreement raised
            self.checkpoints = self.attempt.checkpoints
        else:
            self.checkpoints = self._checkpoint_manager()
        self.hang_watch = HangWatch.for_runner(self)  # dist.step_timeout: started with the attempt (attempt.py)
        loggers = self.metric_loggers() if self.is_main_process else []
        self.telemetry = RunTelemetry(self.run_dir, config, self.state, loggers, active=self.is_main_process)
        self.topology_change = None  # set by a restore on another topology (`note_topology`)
        self._losses = []
        self._skips = SkippedSteps(config.resilience.max_consecutive_skips)
        self.meter = ThroughputMeter(self.world_size)  # the speed, memory and ETA columns of train log lines
        self.stragglers = StragglerWatch(self.rank, self.world_size)  # each rank's step time, at log lines

    def _checkpoint_manager_for(self, run_dir: RunDir) -> CheckpointManager:
        """Rank 0, deciding the run (`Attempt.decide`): the checkpoint manager of `run_dir`, the run it decided on."""
        self.run_dir = run_dir
        return self._checkpoint_manager()

    def _checkpoint_manager(self, token: str = "") -> CheckpointManager:
        """This run's checkpoint manager; `token` (the attempt's timestamp, equal on all ranks) names staging dirs.

        Its class is `checkpoint_manager_class` when a runner class sets one, else the one `ckpt.backend` selects.
        """
        manager_class = self.checkpoint_manager_class or select_manager_class(self.config.ckpt.backend, self.world_size)
        manager = manager_class(
            self.run_dir.checkpoints,
            CheckpointPolicy.from_config(self.config.ckpt),
            rank=self.rank,
            world_size=self.world_size,
            identity={"config_id": self.run_dir.config_id, "code_id": self.run_dir.code_id},
            token=token,
            timeout_s=self.config.dist.timeout,
        )
        if self.is_main_process and not self.inspection:  # `ckpt.mirror`: uploads beside training, restores
            manager.mirror = mirror_for_run(self.config.ckpt, self.run_dir.path, self.run_dir.root)
        return manager

    def __post_init__(self) -> None:
        """Called once after the user's `__init__`: fill in defaults, place the model, build loaders, restore."""
        self.telemetry.goodput.model_built()
        # Built once every `__init__` has run (the TorchFT layer replaces `telemetry` in its own); the loaders it
        # reads are filled in below by `build_dataloaders`.
        self.evaluator = Evaluator(
            self,
            config=self.config,
            state=self.state,
            dataloaders=self.dataloaders,
            world_size=self.world_size,
            preemption=self.preemption,
            telemetry=self.telemetry,
            meter=self.meter,
            logger=self.logger,
        )
        pretrained = NO_WEIGHTS
        if self.restore_source.kind == "pretrained":
            assert self.restore_source.path is not None  # a pretrained source carries its weights' path
            pretrained = self.read_pretrained(self.restore_source.path)
        self.checkpointing = CheckpointBinding(
            self,
            config=self.config,
            state=self.state,
            rank=self.rank,
            world_size=self.world_size,
            run_dir=self.run_dir,
            checkpoints=self.checkpoints,
            dataloaders=self.dataloaders,
            telemetry=self.telemetry,
            meter=self.meter,
            save_failures=self.save_failures,
            logger=self.logger,
            pretrained=pretrained,
        )
        if self.model is None:
            raise PerdureError(f"{type(self).__name__}.__init__ must assign self.model before it returns")
        self._check_checkpointed()
        self._check_hf_export()
        # The model was initialised from `seed` on every rank alike; from here on each rank draws its own stream
        # (dropout masks differ across ranks; rank 0 keeps the stream of a single-process run).
        stream = self.random_stream()
        if stream > 0:
            seed_everything(derived_seed(self.config.seed, stream))
        self.place_model()
        if self.optimizer is None:
            self.optimizer = build_optimizer(self.model.parameters(), self.config.optim)
        if self.scheduler is None:
            total = self.config.sched.total_steps or self.total_steps_hint()
            self.scheduler = build_scheduler(self.optimizer, self.config.sched, total)
        self.distribute_model()
        if self.config.ema.enabled and self.ema is None:  # of the distributed model: no whole copy of a sharded one
            self.ema = ExponentialMovingAverage(self.unwrap_model(), self.config.ema.decay)
        check_parameter_coverage(self.optimizer, self.model)  # each trainable parameter in the optimizer, once
        check_state_dict_round_trip(self.unwrap_model())  # what a checkpoint saves of it loads back unchanged
        self.build_dataloaders()
        with self.telemetry.goodput.restoring():
            self.restore(self.restore_source)
        self._losses = list(self.state.pending_losses)
        self.wrap_model()

    # ---- override points of a stack ----------------------------------------------------------------------------

    def init_distributed(self) -> tuple[int, int]:
        """Called first in `__init__`; returns (rank, world_size). Must not touch the workspace."""
        return 0, 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    def place_model(self) -> None:
        """Called in `__post_init__` before the default optimizer is built: move `self.model` to its device.

        Must keep the parameter objects (the user's optimizer may already hold them) and must not wrap the model.
        """
        raise NotImplementedError(f"{type(self).__name__}: place_model is implemented by a stack (subclass Runner)")

    def random_stream(self) -> int:
        """Called in `__post_init__` before the model is placed: the index of the random stream this process draws
        from then on (0: the stream of a single-process run). Ranks that must draw the same numbers (tensor-parallel
        peers, whose dropout on a replicated activation must agree) return the same index. Must not draw.
        Default: this process's `data_parallel_rank()`."""
        return self.data_parallel_rank()[0]

    def data_shard(self) -> tuple[int, int]:
        """(index, count): this process's share of every dataset. Processes with the same index read the same
        batches (tensor-parallel peers, the stages of one pipeline). Must not depend on anything `__init__` builds
        after `init_distributed`."""
        return self.rank, self.world_size

    def distribute_model(self) -> None:
        """Called in `__post_init__` once the optimizer and scheduler exist (and an EMA the user built), before
        `ema.enabled` builds the EMA, the dataloaders and the restore: a stack that replaces the model's parameters
        (sharding, splitting into pipeline stages) does it here and moves the optimizer, scheduler and EMA onto the
        new parameters. Must not write anything. Default: none."""

    def wrap_model(self) -> None:
        """Called last in `__post_init__`, after the restore: wrap the model for distributed training (DDP, ...)."""

    def unwrap_model(self) -> nn.Module:
        """The user's module without any wrapper (a `torch.compile` wrapper included): what checkpoints and exports
        hold."""
        return uncompiled(self.model)

    def autocast(self) -> AbstractContextManager:
        """The mixed-precision context `train_step` runs in. Must not change any state."""
        raise NotImplementedError(f"{type(self).__name__}: autocast is implemented by a stack (subclass Runner)")

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate one micro-batch's (already scaled for accumulation) loss."""
        raise NotImplementedError(f"{type(self).__name__}: backward is implemented by a stack (subclass Runner)")

    def optimizer_step(self) -> bool:
        """Unscale, check, clip and step the optimizer; return False when the step was skipped as non-finite.

        Called once per accumulation window. Must leave gradients zeroed (or None) either way. A user's runner may
        extend it to update objects of its own after the step (a momentum teacher, a target network): call
        `super().optimizer_step()` first, act only when it returned True, and put those objects in `self.checkpointed`.
        """
        raise NotImplementedError(f"{type(self).__name__}: optimizer_step is implemented by a stack (subclass Runner)")

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward/backward; DDP stacks skip the gradient all-reduce until the last."""
        return NO_CONTEXT

    def extra_states(self) -> dict[str, Stateful]:
        """Replicated objects a stack adds to checkpoints after the optimizer and scheduler (e.g. a GradScaler)."""
        return {}

    def data_parallel_rank(self) -> tuple[int, int]:
        """(rank, size) of this process among all the processes that read different training batches: the train
        sampler's shard, and by default the random stream the process draws from.

        Default: `data_shard()`. TorchFT replica groups span groups x group-local shards. Must not change state.
        """
        return self.data_shard()

    def begin_step(self) -> bool:
        """Called at the start of every accumulation window, before its first forward (gradients are zero).

        Return False to train no window now: the loop then reads its data again from the current position (e.g. a
        TorchFT replica group that just healed from a peer, whose position moved). May change the training state
        only as a whole restore does (all of it, consistently). Default: True.
        """
        return True

    def commit_step(self) -> bool:
        """Called once per window after the last backward, before the data position advances and the optimizer
        steps: whether this step counts. False drops the window's gradients: no optimizer step, `global_step` and
        the data position stay, and the loop reads the same samples again (nothing consumed twice, nothing skipped).

        A TorchFT replica group averages the gradients across the groups here and returns the groups' vote
        (`should_commit`). Must leave the gradients as the optimizer step should see them. Default: True.
        """
        return True

    # ---- user override points ----------------------------------------------------------------------------------

    def train_step(self, batch: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """Forward one micro-batch and return its loss (or a mapping holding `loss`).

        Called inside `autocast()` for every micro-batch. Must not call backward, step the optimizer or change
        `self.state`: the runner owns those, which is what makes accumulation, skipping and resuming exact.
        """
        inputs, target = self.unpack_batch(batch)
        return self.required_criterion()(self.model(inputs), target)

    def evaluate_step(self, batch: Any) -> Mapping[str, torch.Tensor | float]:
        """Metrics of one evaluation batch, averaged over the split weighted by batch size.

        Called under `evaluation_context()` (default `torch.no_grad()`) with the model in eval mode. Must not draw
        from the global RNGs.
        """
        inputs, target = self.unpack_batch(batch)
        return {"loss": self.required_criterion()(self.model(inputs), target)}

    def required_criterion(self) -> Callable[..., torch.Tensor]:
        """`self.criterion`, which the default `train_step` and `evaluate_step` (and a pipeline's schedule) call; a
        PerdureError saying what to do when none is assigned. Not an override point: assign `self.criterion`."""
        if self.criterion is None:
            raise PerdureError(
                f"{type(self).__name__} has no self.criterion: the default train_step and evaluate_step compute "
                "criterion(model(input), target); assign self.criterion in __init__, or override them"
            )
        return self.criterion

    def infer_step(self, batch: Any) -> torch.Tensor:
        """Model output of one batch for `infer`. Called under `evaluation_context()` in eval mode."""
        inputs, _ = self.unpack_batch(batch)
        return self.model(inputs)

    def unpack_batch(self, batch: Any) -> tuple[Any, Any]:
        """The default batch contract: `(input, target)` or `{"input": ..., "target": ...}`, moved to the device."""
        if isinstance(batch, Mapping):
            if "input" not in batch:
                raise PerdureError(
                    f"batch mapping has keys {sorted(batch)}; the default train_step needs 'input' and 'target' "
                    "(override train_step / evaluate_step for other layouts)"
                )
            inputs, target = batch["input"], batch.get("target")
        elif isinstance(batch, (tuple, list)) and len(batch) == 2:
            inputs, target = batch
        else:
            raise PerdureError(
                f"a batch of type {type(batch).__name__} does not fit the default (input, target) contract; "
                "override train_step / evaluate_step"
            )
        return self.to_device(inputs), self.to_device(target)

    def to_device(self, data: Any) -> Any:
        """Move tensors (also inside lists, tuples and dicts) to the runner's device."""
        return data

    def batch_tokens(self, batch: Any) -> int:
        """Tokens in one micro-batch of this rank, for the `tokens_per_s` (and `mfu`) log columns.

        Called once per micro-batch when a runner overrides it (not overridden: no token columns). Count from shapes
        (e.g. `batch[0].numel()`): it runs in the training loop, so it must not move data or read a tensor's values
        (no `.item()`, no device sync) and must not change any state.
        """
        raise NotImplementedError

    def flops_per_token(self) -> float | None:
        """FLOPs of one training step (forward and backward) per token, for the `mfu` log column; None (the
        default): no MFU. E.g. `6 * n_params + 12 * n_layer * n_head * head_dim * seq_len` for a decoder-only
        transformer. Called once when the training loop starts; MFU also needs the device's peak (`perf.peak_flops`,
        else a table of common GPUs)."""
        return None

    # ---- the training lifecycle --------------------------------------------------------------------------------

    def train(self) -> dict[str, dict[str, dict[str, float]]]:
        """Train until the budget is reached, then save, export and return every evaluation's results.

        Begins the attempt first (the only place a runner starts writing into the workspace). Whatever happens, saves
        in flight are drained and the run dir is released before it returns or raises.
        """
        self._begin_attempt()
        status, reason = "failed", "unknown"
        try:
            if self.config.training_mode() == "epochs":
                self.train_epochs()
            else:
                self.train_steps()
            status, reason = "completed", "early stop" if self.state.early_stopped else "budget reached"
        except SystemExit as stop:
            if self.stop_signal:
                status, reason = "preempted", signal.Signals(self.stop_signal).name
            else:
                status, reason = "stopped", f"SystemExit({stop.code})"
            raise
        except KeyboardInterrupt:
            status, reason = "stopped", "KeyboardInterrupt"
            raise
        except BaseException as error:
            status, reason = "failed", f"{type(error).__name__}: {error}"
            record_error(self.attempt.log_file, error)
            raise
        finally:
            self.close(status, reason)
        return self.state.results

    def close(self, status: str = "stopped", reason: str = "closed") -> None:
        """Drain background saves, end the attempt's record and release the run dir. `train()` calls it; call it
        yourself only for a runner you built without training it (e.g. with `from_checkpoint`) once done with it:
        then it writes nothing."""
        try:
            self.checkpointing.report_saves(self.checkpoints.close())
        finally:
            try:
                self.telemetry.finish(*self.hang_watch.outcome(status, reason))
            finally:
                self._release()

    def train_steps(self) -> None:
        """Train until `global_step` reaches `config.steps` (epochs roll over as the data runs out)."""
        budget = self.config.steps
        assert budget is not None  # `train()` calls this in steps mode: `config.steps` is the budget
        self._fit(lambda: self.state.global_step >= budget, f"{budget} steps")

    def train_epochs(self) -> None:
        """Train until `epoch` reaches `config.epochs`."""
        budget = self.config.epochs
        assert budget is not None  # `train()` calls this in epochs mode: `config.epochs` is the budget
        self._fit(lambda: self.state.epoch >= budget, f"{budget} epochs")

    def _fit(self, budget_reached: Callable[[], bool], budget: str) -> None:
        def done() -> bool:
            return budget_reached() or self.state.early_stopped

        self.checkpointing.budget_done = done
        # Installed until the last save is drained: a second SIGINT during a forced save still exits at once.
        self.preemption.install()
        try:
            if self.state.evaluation_pending:
                self._evaluate_pending()
            if done():
                why = "stopped early" if self.state.early_stopped else f"reached its budget of {budget}"
                self.logger.info(
                    "run %s already %s at step %d: nothing to train (raise the budget to continue it)",
                    self.run_dir.path,
                    why,
                    self.state.global_step,
                )
                self._finish()
                return
            self._train_until(done, budget)
        finally:
            self.preemption.uninstall()

    def _train_until(self, done: Callable[[], bool], budget: str) -> None:
        self.logger.info(
            "training %s from step %d (epoch %d) for %s", self.run_dir.path, self.state.global_step,
            self.state.epoch, budget,
        )  # fmt: skip
        loader = self.dataloaders["train"]
        self.cadence = Cadence.from_config(self.config)
        self.save_schedule = SaveSchedule.for_runner(self, default=self.cadence.save_every)  # ckpt.interval (auto)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.checkpoints.start()
        self.telemetry.begin_training(self.config.steps if self.config.training_mode() == "steps" else None)
        self._start_meter(loader, counts_tokens=type(self).batch_tokens is not BaseRunner.batch_tokens)
        while not (done() or self.stop_requested()):
            epoch_started = self.state.samples_in_epoch == 0
            consumed = 0
            for window in self._accumulation_windows(loader):
                consumed += len(window)
                if not self._train_window(window, loader):
                    break  # the step did not count: read again from the data position
                if done() or self.stop_requested():
                    break
            else:
                if epoch_started and consumed == 0:
                    raise PerdureError("the 'train' dataloader yields no batches: check the dataset and batch_size")
                self._end_epoch()
        self.hang_watch.enter("closing")  # the final or preemption save, the drain and the export: not a step
        if done() and not self.stop_signal:
            self._finish()
        else:
            self._stop_for_preemption()

    def _accumulation_windows(self, loader: ResumableLoader) -> Iterator[list[Any]]:
        """Groups of `accum_steps` micro-batches; an epoch's last window may be shorter and is stepped as is."""
        accum = self.config.accum_steps
        window: list[Any] = []
        for batch in self.hang_watch.fetching(loader.iter_epoch(self.state.epoch, self.state.samples_in_epoch)):
            window.append(batch)
            if len(window) == accum:
                yield window
                window = []
        if window:
            yield window

    def _train_window(self, window: list[Any], loader: ResumableLoader) -> bool:
        """One optimizer step over `window`; False when it did not count (`begin_step` / `commit_step`)."""
        if not self.begin_step():
            return False
        # Gradients are zero here: `optimizer_step` leaves them so, and `_fit` zeroes them before the first window.
        loss = self.forward_backward(window)
        self.checkpoints.wait_for_snapshots()  # an async save may still be copying what the step will change
        if not self.commit_step():
            self.optimizer.zero_grad(set_to_none=True)
            return False
        samples = loader.take_samples(len(window)) * loader.world_size  # every rank reads batches of equal size
        self.state.samples_in_epoch += samples
        self.meter.add(samples, window)
        stepped = self.optimizer_step()
        if not stepped:
            self.state.skipped_steps += 1
            self._skips.skipped(self.state.global_step, self.state.skipped_steps)
            return True
        self._skips.stepped()
        if self.scheduler is not None:
            self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.unwrap_model())
        self.checkpointing.reserve_snapshot_buffers()
        self.state.global_step += 1
        self._losses.append(loss)
        self.telemetry.step(self.state.global_step)
        self._end_step(epoch_ending=self.state.samples_in_epoch >= (loader.samples_per_epoch() or math.inf))
        return True

    def _end_step(self, epoch_ending: bool) -> None:
        step, cadence = self.state.global_step, self.cadence
        if step % cadence.log_every == 0:
            self._log_train_progress()
        if cadence.by_epoch:
            every = cadence.save_every_steps
            if every and step % every == 0 and not epoch_ending:
                self.save_checkpoint("interval")
            return
        self._evaluate_and_save(step)

    def _end_epoch(self) -> None:
        self.state.epoch += 1
        self.state.samples_in_epoch = 0
        if self.cadence.by_epoch:
            self._evaluate_and_save(self.state.epoch)

    def _evaluate_and_save(self, count: int) -> None:
        """At the end of a step (step mode) or an epoch (epoch mode) numbered `count`: evaluate and save when due;
        an improved score is saved too (`ckpt.save_best`), so `best` always names a checkpoint."""
        cadence = self.cadence
        self.is_best = False
        if count % cadence.eval_every == 0 and self.evaluator.splits() and not self._evaluate_and_score():
            return  # a preemption signal stopped the evaluation: the loop saves this position and exits
        if self.save_schedule.due(count):
            self.save_schedule.plan()  # ckpt.interval auto: the next save's step, kept in this checkpoint
            self.save_checkpoint("interval")
        elif self.is_best and cadence.save_best:
            self.save_checkpoint("best")

    @watched_phase("evaluation")  # not a step: dist.step_timeout does not count it
    def _evaluate_and_score(self) -> bool:
        """The loop's evaluation of every split (`Evaluator.evaluate_and_score`: kept, logged, scored; an improved
        score sets `is_best`); returns True. False when a preemption signal stopped it (nothing of it is kept, the
        position's evaluation is pending, `stop_signal` is set): the caller then saves this position and exits."""
        try:
            if self.evaluator.evaluate_and_score():
                self.is_best = True
        except EvaluationStopped as stopped:
            if stopped.signal:  # agreed by the evaluation itself (an iterable split), not by `stop_requested`
                self.stop_signal = stopped.signal
            return False
        return True

    def _evaluate_pending(self) -> None:
        """The attempt starts from a position whose evaluation a preemption signal stopped: run it now, as the
        uninterrupted run did right after that step. The position is saved already (a position is never saved twice),
        so an improved score points `best` at that checkpoint."""
        if not self.evaluator.splits():  # this attempt has no evaluation splits: nothing to run
            self.state.evaluation_pending = False
            return
        self.logger.info("evaluating step %d, which the last attempt was stopped in", self.state.global_step)
        self.is_best = False
        if not self._evaluate_and_score():
            self._stop_for_preemption()
        if self.is_best and self.config.ckpt.enabled:
            self.checkpoints.point_best(self.checkpointing.position_name())

    def stop_requested(self) -> bool:
        """Called after every optimizer step, and before each batch of the loop's evaluations (as many as every rank
        reads): True when training must stop now (a preemption signal arrived).

        Several ranks agree (every rank returns the same, `StragglerWatch.agreed_signal`). Once a stop is agreed
        (here, or by an evaluation's own agreement over an iterable split) it holds: every later call returns True
        without a collective, so that the loop's check after a stopped evaluation stops too (a pipelined check would
        answer 0 until its collective is read). Must not save or exit: the loop does that.
        """
        if self.stop_signal:
            return True
        signal_now = self.preemption.received or 0
        if self.world_size > 1:  # an evaluation's checks agree at once: its batches are not the steps timed
            signal_now = self.stragglers.agreed_signal(signal_now, at_once=self.evaluator.stops_on_signal)
        self.stop_signal = signal_now
        return self.stop_signal != 0

    def _finish(self) -> None:
        """Training is over (budget or early stop): final checkpoint, drain, export."""
        self.checkpointing.ending = True
        evaluated = str(self.state.global_step) in self.state.results
        if self.config.training_mode() == "steps" and self.evaluator.splits() and not evaluated:
            self.is_best = False
            if not self._evaluate_and_score():
                self._stop_for_preemption()
        self.save_checkpoint("final")
        self.checkpointing.report_saves(self.checkpoints.close())
        if self.config.ckpt.enabled:
            self.write_final_exports()  # every rank: a sharded model is exported collectively
        self.logger.info(
            "finished at step %d (epoch %d); run dir %s", self.state.global_step, self.state.epoch, self.run_dir.path
        )

    def _stop_for_preemption(self) -> None:
        """A signal asked to stop: save this step, drain the writer, exit with 128 + signal (or the configured code)."""
        signum = self.stop_signal
        self.checkpointing.ending = True
        self.logger.warning(
            "received %s: checkpointing step %d and exiting", signal.Signals(signum).name, self.state.global_step
        )
        self.save_checkpoint("preemption")
        self.checkpointing.report_saves(self.checkpoints.close())
        exit_code = self.config.resilience.exit_code
        raise SystemExit(128 + signum if exit_code is None else exit_code)

    @property
    def results(self) -> dict[str, dict[str, dict[str, float]]]:
        return self.state.results

    @property
    def global_step(self) -> int:
        return self.state.global_step

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def best_score(self) -> float | None:
        return self.state.best_score
