"""The checkpoint binding: the runner's side of the checkpoint contract, as a component the runner owns.

    save(reason)           the current position, once: its objects (the runner's `checkpoint_states()` and
                           `checkpoint_local_states()`), its manifest, its texts; a failed save reported, raised when
                           it is the save training ends at
    report_saves(...)      the outcomes of background saves and mirror uploads, at each save and when saves drain
    restore(source)        a checkpoint's objects in their restore order, or `--pretrained` weights into the model
    take_pretrained()      the `--pretrained` weights `read_pretrained` returned, handed over once
    position_name()        the checkpoint name of the current position

`CheckpointBinding` is built in `BaseRunner.__post_init__` (after every `__init__`: the TorchFT layer replaces the
telemetry in its own) with what it reads, passed explicitly; what it needs of the runner later (the objects to save,
the model) it asks through the runner's documented override points (`CheckpointHooks`, runners/checkpointing.py;
declared in `RunnerFields`). The bytes and the commit protocol belong to the `CheckpointManager` (checkpoints/).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import yaml

from perdure.checkpoints.commit import checkpoint_name, read_pointer
from perdure.checkpoints.hf_export import HF_META
from perdure.checkpoints.snapshot import storage_key
from perdure.checkpoints.weights_fit import check_weights_fit, in_model_layout, with_tied
from perdure.errors import CheckpointSaveError, CheckpointStateError
from perdure.resilience.grace import GraceCheck, find_grace
from perdure.runners.compile import plain_name, plain_state_dict, strip_compile_prefix, uncompiled
from perdure.runners.hf_export import hf_metadata, hf_requested
from perdure.runners.losses import losses_as_floats
from perdure.runners.rng import derived_seed, seed_everything
from perdure.wording import counted

if TYPE_CHECKING:
    from pathlib import Path

    from perdure.checkpoints.async_save import SaveOutcome
    from perdure.checkpoints.base import CheckpointManager
    from perdure.checkpoints.resolve import CheckpointInfo
    from perdure.checkpoints.source import RestoreSource
    from perdure.config import RunnerConfig
    from perdure.data.loader import ResumableLoader
    from perdure.runners.fields import RunnerFields
    from perdure.runners.state import RunnerState
    from perdure.runners.telemetry import RunTelemetry
    from perdure.runners.throughput import ThroughputMeter
    from perdure.workspace.run_dir import RunDir

NO_WEIGHTS = object()  # `take_pretrained` before any or after they were taken


class CheckpointBinding:
    """What the runner saves and restores, when a position counts as saved, and how a failed save is reported; see
    the module docstring."""

    def __init__(
        self,
        hooks: RunnerFields,
        *,
        config: RunnerConfig,
        state: RunnerState,
        rank: int,
        world_size: int,
        run_dir: RunDir,
        checkpoints: CheckpointManager,
        dataloaders: dict[str, ResumableLoader],
        telemetry: RunTelemetry,
        meter: ThroughputMeter,
        save_failures: list[str],
        logger: logging.Logger,
        pretrained: Any = NO_WEIGHTS,
    ) -> None:
        self.hooks = hooks
        self.config = config
        self.state = state
        self.rank = rank
        self.world_size = world_size
        self.run_dir = run_dir
        self.checkpoints = checkpoints
        self.dataloaders = dataloaders  # filled in later by `build_dataloaders`: read at the restore
        self.telemetry = telemetry
        self.meter = meter  # a save's time is kept out of the step time
        self.save_failures = save_failures  # the runner's list: each failed save (or mirror upload) appended
        self.logger = logger
        self.saved_position: tuple[int, int, int] | None = None  # (global_step, epoch, samples_in_epoch) saved last
        self.ending = False  # the final or preemption save is under way: its failure is never only a warning
        self.budget_done: Callable[[], bool] = lambda: False  # set when training starts
        self._pretrained = pretrained  # `read_pretrained`'s, until `take_pretrained`
        self._snapshot_buffers_reserved = False  # by the first optimizer step of the attempt
        self._config_yaml: tuple[dict, str] | None = None  # the config's plain form and its YAML, as last written
        self._grace: GraceCheck | None = None  # made at the first save: compares it with the grace window

    def position_name(self) -> str:
        """The checkpoint name of the current position: `ckpt-e…` at an epoch end in epoch mode, else `ckpt-s…`."""
        if self.config.training_mode() == "epochs" and self.state.samples_in_epoch == 0:
            return checkpoint_name(epoch=self.state.epoch)
        return checkpoint_name(step=self.state.global_step)

    # ---- saving ------------------------------------------------------------------------------------------------

    def save(self, reason: str, losses: list[torch.Tensor | float]) -> Path | None:
        """`save_checkpoint`'s work (its contract: runners/checkpointing.py); `losses` are the loss values since the
        last log line, kept in the state so a resume logs the same averages."""
        self.report_saves(self.checkpoints.take_outcomes())
        if not self.config.ckpt.enabled:
            return None
        position = (self.state.global_step, self.state.epoch, self.state.samples_in_epoch)
        if position == self.saved_position or self.state.global_step == 0:
            return None
        name = self.position_name()
        is_best = self.state.best_step == self.state.global_step
        meta = {
            "global_step": self.state.global_step,
            "epoch": self.state.epoch,
            "samples_in_epoch": self.state.samples_in_epoch,
            "reason": reason,
            "score": self.state.best_score if is_best else None,
        }
        self.state.pending_losses = losses_as_floats(losses)  # plain numbers: one device sync per save
        started = time.perf_counter()
        self.telemetry.before_checkpoint()
        try:
            path = self.checkpoints.save(
                name,
                self.hooks.checkpoint_states(),
                self.hooks.checkpoint_local_states(),
                meta=meta,
                is_best=is_best,
                texts=self.texts(),
                persistent=reason != "interval" or is_best,
                deferred=self.tensors_changed_by_step(),
            )
        except CheckpointStateError:
            raise  # no save of this state will ever work: the run stops at its first save
        except CheckpointSaveError as error:
            self.save_failed(name, reason, str(error))
            return None
        self.saved_position = position
        self.meter.exclude(time.perf_counter() - started)  # not training time: kept out of step_time
        self.telemetry.goodput.blocked("checkpoint_stall", time.perf_counter() - started)
        if path is not None:
            seconds = time.perf_counter() - started
            if self.config.ckpt.async_mode == "disabled":
                self.logger.info("saved %s (%s) in %.3fs", path.name, reason, seconds)
                self.telemetry.checkpoint(path.name, seconds=seconds, best=path.name if is_best else None)
                self._save_took(seconds)
            else:
                self.logger.info("snapshotted %s (%s) in %.3fs; writing in the background", path.name, reason, seconds)
        return path

    def texts(self) -> dict[str, str]:
        """The small text files of each checkpoint: its config, and `hf.json` when `ckpt.export_format` has hf."""
        plain = self.config.to_plain()
        if self._config_yaml is None or self._config_yaml[0] != plain:  # dumped again only when it changed: the
            self._config_yaml = (plain, yaml.safe_dump(plain, sort_keys=True))  # dump was most of a small save's time
        texts = {"config.yaml": self._config_yaml[1]}
        if hf_requested(self.hooks):
            texts[HF_META] = hf_metadata(self.hooks)
        return texts

    def reserve_snapshot_buffers(self) -> None:
        """After each optimizer step; once per attempt, the first time: the host buffers of async saves are made in
        the background while training goes on (see `CheckpointManager.reserve_snapshot_buffers`)."""
        if self._snapshot_buffers_reserved:
            return
        self._snapshot_buffers_reserved = True
        if self.config.ckpt.enabled and self.config.ckpt.async_mode != "disabled":
            # by storage: a parameter is in the model's state dict and among what the step changes
            tensors: dict[tuple[str, int], torch.Tensor] = {}
            for tensor in [*self.hooks.unwrap_model().state_dict().values(), *self.tensors_changed_by_step()]:
                tensors.setdefault(storage_key(tensor), tensor)
            self.checkpoints.reserve_snapshot_buffers(tensors.values())

    def tensors_changed_by_step(self) -> list[torch.Tensor]:
        """Tensors only the optimizer step (and the EMA update after it) changes: an async save copies them late."""
        tensors: list[torch.Tensor] = list(self.hooks.unwrap_model().parameters())
        for state in self.hooks.optimizer.state.values():
            tensors.extend(value for value in state.values() if isinstance(value, torch.Tensor))
        if self.hooks.ema is not None:
            tensors.extend(self.hooks.ema.shadow.values())
        return tensors

    def report_saves(self, outcomes: list[SaveOutcome]) -> None:
        """The outcomes of background saves (`CheckpointManager.take_outcomes` / `close`) and failed mirror uploads:
        logged and recorded; a failed one handled as `save_failed` says."""
        for failure in self.checkpoints.mirror_failures():  # the uploader warned already; recorded like a failed save
            self.save_failures.append(f"{failure.name} (mirror): {failure.error}")
            self.telemetry.save_failed(failure.name, f"mirror: {failure.error}")
        for outcome in outcomes:
            if outcome.fatal:
                raise CheckpointStateError(outcome.error)
            if outcome.error is None:
                self.logger.info("committed %s (%s) in the background in %.2fs", outcome.name, outcome.reason,
                                 outcome.seconds)  # fmt: skip
                best = read_pointer(self.run_dir.checkpoints, "best")
                self.telemetry.checkpoint(outcome.name, seconds=outcome.seconds, best=best, background=True)
                self._save_took(outcome.seconds)
            else:
                self.save_failed(outcome.name, outcome.reason, outcome.error)

    def _save_took(self, seconds: float) -> None:
        if self._grace is None:
            self._grace = GraceCheck(find_grace(self.config.resilience.grace_s), self.logger)
        self._grace.saved(seconds)

    def save_failed(self, name: str, reason: str, error: str) -> None:
        """A save failed: always reported; raised for final / preemption saves and with `ckpt.on_error=raise`."""
        self.save_failures.append(f"{name}: {error}")
        self.telemetry.save_failed(name, error)
        message = (
            f"checkpoint {name} ({reason}) failed: {error}. Its partial directory was removed and every committed "
            f"checkpoint is intact (latest: {read_pointer(self.run_dir.checkpoints, 'latest')})."
        )
        # The save of the position training ends at is the one a rerun needs: losing it is never just a warning.
        final = (self.ending or self.budget_done()) and name == self.position_name()
        if final or reason in ("final", "preemption") or self.config.ckpt.on_error == "raise":
            raise CheckpointSaveError(message)
        self.logger.error("%s Training goes on (ckpt.on_error=warn).", message)

    # ---- restoring ---------------------------------------------------------------------------------------------

    def restore(self, source: RestoreSource) -> None:
        """`restore`'s work on every stack (its contract: runners/checkpointing.py): a checkpoint's objects in the
        order `checkpoint_states` gives them, then the rank-local ones; or `--pretrained` weights into the model."""
        self.logger.info("%s", source.describe())
        if source.kind in ("resume", "checkpoint"):
            info = source.info
            assert info is not None  # a resume or checkpoint source carries its checkpoint
            if not self.checkpoints.load(info, self.hooks.checkpoint_states(), self.hooks.checkpoint_local_states()):
                seed = derived_seed(self.config.seed, self.hooks.random_stream(), self.state.global_step)
                seed_everything(seed)
                self.logger.warning(
                    "%s was written by %s and holds no state for rank %d: its RNGs are seeded from (seed, rank, "
                    "step) = %d instead; its data position comes from the replicated state",
                    info.name,
                    counted(info.manifest.get("world_size"), "rank"),
                    self.rank,
                    seed,
                )
            self.saved_position = (self.state.global_step, self.state.epoch, self.state.samples_in_epoch)
            self.hooks.topology_change = self.hooks.note_topology(info)
            self._note_dataset_change(info)
        elif source.kind == "pretrained":
            assert source.path is not None  # a pretrained source carries its weights' path
            weights = in_model_layout(self.take_pretrained(), source.path, self.hooks.state_dict_adapter())
            load_matching_weights(self.hooks.unwrap_model(), weights, source.path)

    def take_pretrained(self) -> Any:
        """The `--pretrained` weights `read_pretrained` returned when the runner was built, handed over once (the
        restore, or a stack that reads them into its shards) and no longer held here."""
        weights, self._pretrained = self._pretrained, NO_WEIGHTS
        if weights is NO_WEIGHTS:
            raise RuntimeError("take_pretrained: the run starts from no --pretrained weights, or they were taken")
        return weights

    def _note_dataset_change(self, info: CheckpointInfo) -> None:
        """A train split whose length changed since the checkpoint (files added to a folder between attempts): an
        epoch's order is a function of the length too, so the resume cannot be exact. Say so, and what it does to the
        epoch the checkpoint interrupted; training goes on, since the new data may be what the user wants."""
        change = self.dataloaders["train"].length_change()
        if change is None or not self.hooks.is_main_process:
            return
        was, now = change
        self.logger.warning(
            "DATASET CHANGE: %s was written when the train split had %d samples; it has %d now. Epoch %d goes on "
            "from its sample %d in an order of %d samples, not the order of %d it was begun in, so it may read some "
            "samples twice and others not at all, and the resume is not bit-exact. To continue exactly, give the "
            "train split back the %d samples it had, in the same order.",
            info.name,
            was,
            now,
            self.state.epoch,
            self.state.samples_in_epoch,
            now,
            was,
            was,
        )


def load_matching_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], source: Path) -> None:
    """`model.load_state_dict(weights)`, refusing with a CheckpointError that names the missing, unexpected and
    mis-shaped keys (the first few of each, and how many) instead of torch's long traceback. Names are matched
    without `torch.compile`'s `_orig_mod.`, so weights load into a compiled or an uncompiled model alike."""
    model = uncompiled(model)
    names = {plain_name(key): key for key in model.state_dict()}
    expected = plain_state_dict(model)
    weights = with_tied(strip_compile_prefix(weights), expected)  # `save_pretrained` leaves tied copies out
    check_weights_fit(
        type(model).__name__,
        {key: _shape(value) for key, value in expected.items()},
        {key: _shape(value) for key, value in weights.items()},
        source,
    )
    model.load_state_dict({names[key]: value for key, value in weights.items()})


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
