"""Checkpointing: the runner's override points of the checkpoint contract (what is saved and restored, weights read,
exports, the constructors from a checkpoint or weights); the state and the work are the component's
(`CheckpointBinding`, runners/checkpoint_binding.py)."""

from __future__ import annotations

import re
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from perdure.checkpoints.base import Stateful
from perdure.checkpoints.commit import read_pointer
from perdure.checkpoints.hf_adapter import StateDictAdapter
from perdure.checkpoints.read import read_weights
from perdure.checkpoints.resolve import CheckpointInfo, resolve_path
from perdure.checkpoints.source import RestoreSource
from perdure.checkpoints.weights_fit import in_model_layout
from perdure.config import RunnerConfig
from perdure.errors import CheckpointError, PerdureError
from perdure.loggers.console import get_logger
from perdure.resilience.hang_watch import watched_phase
from perdure.runners.checkpoint_binding import CheckpointBinding, load_matching_weights
from perdure.runners.compile import plain_state_dict
from perdure.runners.export import StreamSource, export_streamed, export_weights, save_safetensors
from perdure.runners.fields import RunnerFields
from perdure.runners.hf_export import check_hf_export, export_hf, write_whole_weights
from perdure.runners.rng import RNGState
from perdure.safe_io import read_yaml
from perdure.wording import counted
from perdure.workspace.identity import canonical_config, config_diff
from perdure.workspace.run_dir import resolve_run_dir

if TYPE_CHECKING:
    from typing_extensions import Self


# The names of the runner's own objects, replicated and rank-local, on every stack: not for `self.checkpointed`.
RUNNER_STATE_NAMES = frozenset(
    {"state", "model", "ema", "optimizer", "scheduler", "scaler", "engine", "ft", "data", "rng"}
)
USER_STATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")  # no dots: DCP keys are `name.` + the object's keys


class CheckpointHooks(RunnerFields):
    """The checkpoint binding's override points, with their defaults (`BaseRunner` inherits them; the stacks and the
    TorchFT layer override them): which objects go into a checkpoint and in what order they come back, the save and
    the restore (whose work the component `self.checkpointing` does: runners/checkpoint_binding.py), how
    `--pretrained` weights are read and mapped, the exports, and the `from_checkpoint` / `from_pretrained`
    constructors. The bytes and the commit protocol belong to the CheckpointManager (checkpoints/)."""

    checkpointing: CheckpointBinding  # built by `BaseRunner.__post_init__`

    def checkpoint_states(self) -> dict[str, Stateful]:
        """Replicated objects, in restore order: state, model, EMA, optimizer, scheduler, the stack's extras, then the
        user's own (`self.checkpointed`)."""
        states: dict[str, Stateful] = {"state": self.state, "model": self.unwrap_model()}
        if self.ema is not None:
            states["ema"] = self.ema
        states["optimizer"] = self.optimizer
        if self.scheduler is not None:
            states["scheduler"] = self.scheduler
        states.update(self.extra_states())
        for key, state in self.checkpointed.items():
            if key in states:  # a stack's own name, which `_check_checkpointed` does not know of
                raise PerdureError(_name_taken(key))
            states[key] = state
        return states

    def _check_checkpointed(self) -> None:
        """In `__post_init__`, before anything is restored: the user's own objects (`self.checkpointed`) have names a
        checkpoint can hold and can be saved and restored."""
        for key, state in self.checkpointed.items():
            if not isinstance(key, str) or not USER_STATE_NAME.fullmatch(key):
                raise PerdureError(
                    f"self.checkpointed[{key!r}]: a name is a Python identifier of at most 64 characters (letters, "
                    "digits, underscores), e.g. 'teacher'"
                )
            if key in RUNNER_STATE_NAMES:
                raise PerdureError(_name_taken(key))
            missing = [name for name in ("state_dict", "load_state_dict") if not callable(getattr(state, name, None))]
            if missing:
                raise PerdureError(
                    f"self.checkpointed[{key!r}]: an object of type {type(state).__name__} has no "
                    f"{' or '.join(name + '()' for name in missing)}; give an "
                    "object with both (an nn.Module, an optimizer, or a class of your own whose state_dict() returns "
                    "tensors and plain data)"
                )

    def checkpoint_local_states(self) -> dict[str, Stateful]:
        """Rank-local objects, restored after everything else: data position, then the RNGs."""
        return {"data": _DataPosition(self), "rng": RNGState()}

    @watched_phase("checkpoint")  # not a step: dist.step_timeout does not count it
    def save_checkpoint(self, reason: str) -> Path | None:
        """Save the current position (once per position); `reason` (interval, best, final, preemption) goes into the
        manifest. Async modes return as soon as the snapshot is handed over. A failed save is reported and, unless it
        is a final or preemption save or `ckpt.on_error=raise`, training goes on.

        Called by the loop at its save points (the interval, an improved score, the end, a preemption signal), on
        every rank; the work is `self.checkpointing.save` (runners/checkpoint_binding.py). A stack or the TorchFT
        layer extends it (saving state of its own at the same position) and calls `super().save_checkpoint(reason)`;
        it may not change the training state."""
        return self.checkpointing.save(reason, self._losses)

    def restore(self, source: RestoreSource) -> None:
        """Called once in `__post_init__`, after the dataloaders are built and before the model is wrapped: load what
        the run starts from (`source`, decided when the runner was built): a checkpoint's objects in the order state,
        model, EMA, optimizer, scheduler, the stack's extras, the user's, then data and RNGs; or `--pretrained`
        weights into the model (`self.checkpointing.restore`). A stack overrides it to restore its own way (the
        engine builds first, weights read into shards) and calls `super().restore(source)` for the rest; the TorchFT
        layer adds its replica group's state. Must restore all of a position or raise."""
        self.checkpointing.restore(source)

    def note_topology(self, info: CheckpointInfo) -> dict[str, Any] | None:
        """Called by the restore of checkpoint `info`, on every rank: what changed between the topology that wrote it
        and this attempt's (logged once, as a warning), as the attempt's record keeps it (`topology_change`), or None
        when nothing did. Default: the world size, and with it the global batch. The parallel stack compares its
        mesh axes. Must not change any state."""
        before = info.manifest.get("world_size")
        if not isinstance(before, int) or isinstance(before, bool) or before == self.world_size:
            return None
        per_rank = self.config.loader_options("train")["batch_size"] * self.config.accum_steps
        self.logger.warning(
            "TOPOLOGY CHANGE: %s was written by %s, this attempt runs on %s: the global batch changes from %d "
            "to %d samples per optimizer step (%d per rank x %d accumulation x ranks); the data position continues "
            "from the same sample",
            info.name,
            counted(before, "rank"),
            counted(self.world_size, "rank"),
            per_rank * before,
            per_rank * self.world_size,
            self.config.loader_options("train")["batch_size"],
            self.config.accum_steps,
        )
        batches = [per_rank * before, per_rank * self.world_size]
        return {"world_size": [before, self.world_size], "global_batch": batches}

    def load_pretrained(self, path: Path, ema: bool = False) -> None:
        """Load model (or EMA) weights only, from an exported `.pth` file or any checkpoint path."""
        weights = in_model_layout(read_weights(Path(path), ema=ema), Path(path), self.state_dict_adapter())
        load_matching_weights(self.unwrap_model(), weights, Path(path))

    def read_pretrained(self, path: Path) -> Any:
        """Called when the run starts from `--pretrained` (on rank 0 while it decides the run, to refuse unreadable
        weights before anything is written; then on every rank in `__init__`): what the restore loads the weights
        from. Default: `read_weights(path)`, the full state dict on every rank. The parallel stack opens them to read
        slice by slice instead (`open_weight_slices`: names and shapes now, each rank's shards once it has them)."""
        return read_weights(path)

    def state_dict_adapter(self) -> StateDictAdapter | None:
        """How the model's state dict maps to and from the Hugging Face layout, or None (the default) when the
        model's own names already are the Hugging Face names (any `transformers.PreTrainedModel`).

        Override it for a model whose names differ (TorchTitan's Llama: return its `Llama3StateDictAdapter`). Called
        after `__init__` by the `hf` export and when Hugging Face weights are read into the model (`--pretrained`),
        on any rank that maps weights; it may be called more than once, must return the same mapping each time on
        every rank, and may not change the model or the runner's state.
        """
        return None

    def hf_config(self) -> Any:
        """The Hugging Face config the `hf` export writes as `config.json` for a model that is not a
        `transformers.PreTrainedModel` (whose own `config` is used): a `transformers.PretrainedConfig` (written by
        its `save_pretrained`), or a plain JSON-able dict written as it is (give it `model_type` and `architectures`
        so `AutoModel*.from_pretrained` finds the class). None (the default): such a model has no `hf` export, and
        `ckpt.export_format: [hf]` is refused before training starts.

        Called on the main process, after `__init__`, before training (to check it) and by the export; it may not
        change the model or the runner's state.
        """
        return None

    def write_final_exports(self) -> None:
        """When training completes, on every rank: `export_model()` for the pth / safetensors formats of
        `ckpt.export_format`, `export_hf()` for hf."""
        formats = self.config.ckpt.export_format
        formats = [formats] if isinstance(formats, str) else formats
        if "pth" in formats or "safetensors" in formats:
            self.export_model()
        if "hf" in formats:
            self.export_hf()

    def export_hf(self, target: str | Path | None = None) -> Path | None:
        """Write a directory `transformers.AutoModel*.from_pretrained` loads (`target`, default `<run dir>/hf`, and
        `hf-ema` beside it with EMA), cast to `ckpt.export_dtype`: a `PreTrainedModel` through `save_pretrained`, any
        other model through `state_dict_adapter().to_hf` and `hf_config()`. Sharded models are written shard by shard
        (runners/hf_export.py). Called on every rank (collective); returns the directory on the main process."""
        return export_hf(self, None if target is None else Path(target))

    def write_hf_weights(self, staging: Path, ema: bool) -> None:
        """Write the weights of the `hf` export (the model's, or its EMA's when `ema`) into `staging`: the
        safetensors files (and their index), or everything `save_pretrained` writes. Each stack overrides it with the
        way its weights are reached (parallel_runner.py: shard by shard; deepspeed_runner.py: tensor by tensor), using
        the functions of runners/hf_export.py.

        Called by `export_hf` on every rank, once for the model, then once for the EMA when there is one, after
        training or on a runner built by `from_checkpoint`; a stack may take part in collectives here, and then every
        rank must make the same calls. It may not change the model, the EMA or the runner's state, and may write only
        into `staging`: the export writes `config.json` there when this did not, and publishes the directory.

        Default (one process, DDP): the main process holds the full weights (`plain_state_dict`, the EMA's
        `weights()`) and writes them (`write_whole_weights`: a `PreTrainedModel` without an adapter through its own
        `save_pretrained`); the other ranks write nothing.
        """
        if not self.is_main_process:
            return
        if ema:
            assert self.ema is not None  # `export_hf` makes an EMA job only for a runner with an EMA
            weights = self.ema.weights()
        else:
            weights = plain_state_dict(self.unwrap_model())
        write_whole_weights(self, staging, weights, self.state_dict_adapter())

    def _check_hf_export(self) -> None:
        """In `__post_init__`: refuse `ckpt.export_format: [hf]` for a model with no Hugging Face config."""
        check_hf_export(self)

    def export_model(self) -> Path | None:
        """Write `model.pth` (and `model-ema.pth` with EMA) into the run dir, cast to `ckpt.export_dtype`; also
        `model.safetensors` (`model-ema.safetensors`) when `ckpt.export_format` includes safetensors.

        Called on every rank when training completes (a stack whose model is sharded gathers it collectively); the
        main process writes and returns the path of `model.pth` (or of the first format written), the others None.
        """
        if not self.is_main_process:
            return None
        ema = self.ema.weights() if self.ema is not None else None
        return self.write_exports(plain_state_dict(self.unwrap_model()), ema)

    def write_exports(
        self, weights: dict[str, torch.Tensor] | None, ema: dict[str, torch.Tensor] | None
    ) -> Path | None:
        """Write full (unsharded) weights, and EMA weights, each when given, in every format of `ckpt.export_format`."""
        dtype, formats = self.config.ckpt.export_dtype, self.config.ckpt.export_format
        formats = [formats] if isinstance(formats, str) else formats
        written: list[Path] = []
        for name, state in (("model", weights), ("model-ema", ema)):
            if state is None:
                continue
            if "pth" in formats:
                written.append(export_weights(state, self.run_dir.path / f"{name}.pth", dtype))
            if "safetensors" in formats:
                # published with the file: the run and the checkpoint of these weights, no path of this machine
                position = self.checkpointing.position_name()
                metadata = {"format": "pt", "run": self.run_dir.run_id, "checkpoint": position}
                written.append(save_safetensors(state, self.run_dir.path / f"{name}.safetensors", dtype, metadata))
        return written[0] if written else None

    def stream_exports(self, sources: dict[str, StreamSource]) -> Path | None:
        """`write_exports` for sharded weights, tensor by tensor: `sources` maps `model` / `model-ema` to weights each
        made whole one tensor at a time (`StreamSource`: a collective, so every rank calls this); the main process
        writes each tensor into every format of `ckpt.export_format` as it arrives and holds one at a time, never the
        whole model (`runners/export.py` `export_streamed`). Returns what `write_exports` returns."""
        dtype, formats = self.config.ckpt.export_dtype, self.config.ckpt.export_format
        formats = [formats] if isinstance(formats, str) else formats
        formats = [fmt for fmt in ("pth", "safetensors") if fmt in formats]
        metadata = {}
        if self.is_main_process:  # published with the file, as write_exports does
            metadata = {"format": "pt", "run": self.run_dir.run_id, "checkpoint": self.checkpointing.position_name()}
        written: list[Path] = []
        for name, source in sources.items():
            paths = {fmt: self.run_dir.path / f"{name}.{fmt}" for fmt in formats} if self.is_main_process else None
            export_streamed(source, formats, paths, dtype, metadata)
            written.extend((paths or {}).values())
        return written[0] if written else None

    @classmethod
    def from_checkpoint(cls, path: str | Path, config_class: type[RunnerConfig] = RunnerConfig) -> Self:
        """Rebuild a runner from the config stored in a checkpoint and restore its full state.

        `path` may be a run dir, its `checkpoints/` dir, or one checkpoint dir. Looking at the runner (`evaluate`,
        `infer`, `close`) writes nothing; `train()` continues the checkpoint's own run when the checkpoint is that
        run's latest, else a branch run `<run id>-from-<checkpoint>` beside it.
        """
        info = resolve_path(Path(path))
        stored = read_stored_config(info.path)
        config = config_class.from_plain(stored)
        config.checkpoint = str(info.path)
        config.pretrained = None
        config.resume = "auto"
        if config.lookup("ft.enabled", False):  # a runner rebuilt to look at a run is no TorchFT replica group
            config.ft.enabled = False
        checkpoints = info.path.parent
        if checkpoints.name == "checkpoints":
            # Rebuild in the workspace and run dir the checkpoint lives in, whatever the code and cwd are now.
            config.workspace.root = str(checkpoints.parent.parent.parent.resolve())
            if isinstance(info.manifest.get("code_id"), str):
                config.workspace.code_id = info.manifest["code_id"]
            run_dir = resolve_run_dir(config, cls.__name__)
            own_run = run_dir.path.resolve() == checkpoints.parent.resolve()
            if own_run and read_pointer(checkpoints, "latest") != info.name:
                # Its own run has moved on: continuing that run would load its latest checkpoint, not this one.
                config.workspace.id = f"{run_dir.run_id}-from-{info.name}"
                get_logger().info("from_checkpoint(%s): training would branch run %s", info.path, config.workspace.id)
        token = _INSPECTION.set(True)
        try:
            return cls(config)
        finally:
            _INSPECTION.reset(token)

    @classmethod
    def from_pretrained(cls, config: RunnerConfig, path: str | Path) -> Self:
        """Build a runner from a copy of `config` and load model weights only from `path` (an export or a checkpoint).
        The caller's `config` is left as it was."""
        config = config.deepcopy()
        config.pretrained = str(path)
        config.checkpoint = None
        return cls(config)


def building_for_inspection() -> bool:
    """True while `from_checkpoint` builds a runner: one built to look at a run records no failed setup."""
    return _INSPECTION.get()


_INSPECTION: ContextVar[bool] = ContextVar("perdure_inspection", default=False)


def check_same_config(config: RunnerConfig, info: CheckpointInfo) -> None:
    """Rank 0, deciding the run (`Attempt.decide`): a checkpoint to continue was made with this config (its
    identity: `canonical_config`), or a CheckpointError shows the difference and what to do instead."""
    stored = read_stored_config(info.path) if (info.path / "config.yaml").exists() else {}
    theirs, ours = canonical_config(stored), canonical_config(config)
    if theirs != ours:
        lines = "\n  ".join(config_diff(theirs, ours, a_label="checkpoint", b_label="current"))
        raise CheckpointError(
            f"checkpoint {info.path} was made with a different config, so resuming it would not continue the "
            f"same run:\n  {lines}\nUse the checkpoint's config (Runner.from_checkpoint), or load only its "
            f"weights with --pretrained {info.path}."
        )


def read_stored_config(checkpoint: Path) -> dict[str, Any]:
    """The config a checkpoint stores (`config.yaml`), read as a file from someone else: a regular file, bounded in
    size and alias expansion (`safe_io.read_yaml`), a mapping. CheckpointError otherwise."""
    path = checkpoint / "config.yaml"
    try:
        stored = read_yaml(path)
    except (OSError, yaml.YAMLError) as error:
        raise CheckpointError(f"cannot read the config stored in {path}: {error}") from None
    if not isinstance(stored, dict):
        raise CheckpointError(f"{path} holds no config mapping; it is not a perdure checkpoint's config")
    return stored


class _DataPosition:
    """The training loader's rank-local position, as a Stateful for checkpoints."""

    def __init__(self, runner: RunnerFields) -> None:
        self.runner = runner

    def state_dict(self) -> dict[str, Any]:
        state = self.runner.state
        return {"train": self.runner.dataloaders["train"].position(state.epoch, state.samples_in_epoch)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.runner.dataloaders["train"].restore(state["train"])


def _name_taken(key: str) -> str:
    return (
        f"self.checkpointed[{key!r}]: the runner saves an object of its own as {key!r}; choose another name, "
        f"e.g. 'my_{key}'"
    )
