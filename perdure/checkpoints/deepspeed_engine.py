"""DeepSpeedCheckpointManager: the DeepSpeed engine's own checkpoints, committed like every other backend's.

A checkpoint directory holds

    engine/                           the engine's tag directory, `engine.save_checkpoint(<staging>, "engine", ...)`:
      mp_rank_00_model_states.pt        module weights, DeepSpeed's counters and perdure's replicated state
                                        (`client_state`); ZeRO 0-2: written by data-parallel rank 0
      zero_pp_rank_{r}_mp_rank_00_model_states.pt    the same per rank under ZeRO-3 (weights partitioned)
      [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt   rank r's optimizer partition (ZeRO 1-3, bf16)
    <key>.pth                         a `StreamedState` (the ZeRO-3 EMA: `ema.pth`), its whole tensors written one at a
                                      time by rank 0 (a torch.save file); the client_state keeps its small rest and
                                      the file's name
    zero_to_fp32.py, zero_to_torch.py DeepSpeed's recovery scripts (rank 0, whenever ZeRO files are written)
    rank{r:05d}.pth                   rank-local state: RNGs and data position (every rank)
    config.yaml, manifest.json        as with every backend

Every rank enters `engine.save_checkpoint` with the same staging directory and `save_latest=False`; the engine's file
I/O is perdure's `RecordingIO` (see `deepspeed_io.py`), so each rank knows exactly which files it wrote, with their
checksums, and hands them to the one commit protocol (`CheckpointManager.commit_job`). DeepSpeed's `latest` file is
never written nor read: a load always names the tag, and a load that finds nothing is an error, not a warning.

A checkpoint written by another number of ranks is converted to DeepSpeed's universal format first and kept as a
derived checkpoint beside it (see `deepspeed_universal.py`).
"""

from __future__ import annotations

import abc
import contextlib
import io
import logging
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.base import CheckpointManager, Stateful
from perdure.checkpoints.commit import FileRecord, hash_file, read_manifest, write_file
from perdure.checkpoints.deepspeed_files import TAG, check_engine_files, check_tag_dir
from perdure.checkpoints.deepspeed_universal import UniversalSource, prune_derived
from perdure.checkpoints.file import _save, local_file, read_local_states
from perdure.checkpoints.read import WeightsFormat, register_format
from perdure.checkpoints.safe_unpickle import deepspeed_loads_restricted, deepspeed_refusal, load_torch_file
from perdure.errors import CheckpointError
from perdure.private_api import set_load_universal_checkpoint

logger = logging.getLogger("perdure")

CLIENT_KEY = "perdure"  # perdure's replicated state inside the engine's client_state
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class EngineState:
    """The DeepSpeed engine (module, optimizer, DeepSpeed's counters) as one entry of the runner's checkpoint states.

    Only the DeepSpeed backend can save it: the engine writes its own (partitioned) files.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def state_dict(self) -> dict[str, Any]:
        raise CheckpointError("the DeepSpeed engine's state is saved by the deepspeed checkpoint backend only")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise CheckpointError("the DeepSpeed engine's state is loaded by the deepspeed checkpoint backend only")


class StreamedState(abc.ABC):
    """A replicated state no rank should hold whole at once (the ZeRO-3 EMA's whole shadows): instead of pickling its
    `state_dict()` into the engine's client_state, the backend has every rank call `write_tensors` (a collective: its
    tensors made whole one at a time, written by rank 0 into `<key>.pth` of the checkpoint) and keeps only
    `small_state()` in the client_state, with the file's name under `STREAMED_FILE`."""

    @abc.abstractmethod
    def write_tensors(self, path: Path | None) -> None:
        """On every rank: write the whole tensors to the torch.save file `path` (rank 0; None on the others)."""

    @abc.abstractmethod
    def small_state(self) -> dict[str, Any]:
        """What the client_state keeps: everything but the tensors."""

    @abc.abstractmethod
    def load_tensors(self, small: dict[str, Any], path: Path) -> None:
        """Restore from `small_state()`'s dict and the file `path` (read through the allow-list), every rank."""


STREAMED_FILE = "streamed_file"


class DeepSpeedCheckpointManager(CheckpointManager):
    """Collective: every rank enters `save` and `load` together. See the module docstring for the layout."""

    backend = "deepspeed"
    collective = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._universal: UniversalSource | None = None  # a restore from another world size, converted

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_universal"] = None
        return state

    def start(self) -> None:
        """Training starts (rank 0 holds the run lock): keep a fresh universal conversion beside its original."""
        super().start()
        universal = self._universal
        if universal is not None and self.rank == 0 and self.policy.enabled:
            if universal.checkpoint.parent.resolve() == self.root.resolve():
                universal.commit()

    def close(self) -> list[Any]:
        try:
            return super().close()
        finally:
            if self._universal is not None:
                self._universal.discard()

    def prune(self, protected: frozenset[str] = frozenset()) -> list[Path]:
        """Retention as for every backend; a derived universal checkpoint goes with its original."""
        removed = super().prune(protected)
        if self.policy.enabled and self.rank == 0:
            prune_derived(self.root)
        return removed

    def snapshot_states(
        self, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The engine stays itself (it writes its files in `write`); every other object gives its state dict."""
        replicated = {
            key: state if key == "engine" or isinstance(state, StreamedState) else state.state_dict()
            for key, state in states.items()
        }
        return replicated, {key: state.state_dict() for key, state in local_states.items()}

    def write(self, staging: Path, replicated: dict[str, Any], local: dict[str, Any]) -> dict[str, FileRecord]:
        from perdure.checkpoints.deepspeed_io import recording_io

        holder = replicated.get("engine")
        if not isinstance(holder, EngineState):
            raise CheckpointError("the deepspeed checkpoint backend saves a DeepSpeed engine: use stack=deepspeed")
        engine = holder.engine
        client: dict[str, Any] = {}
        streamed: dict[str, FileRecord] = {}
        for key, value in replicated.items():
            if isinstance(value, StreamedState):  # every rank, in the same order: collectives
                name = f"{key}.pth"
                value.write_tensors(staging / name if self.rank == 0 else None)
                if self.rank == 0:
                    streamed[name] = hash_file(staging / name, chunk=1 << 20)  # no 8 MB buffer: a bounded save
                client[key] = {**value.small_state(), STREAMED_FILE: name}
            elif key != "engine":
                client[key] = value
        io = recording_io(engine)
        # Collective (DeepSpeed barriers inside): every rank is here, in the training loop, at the same step.
        engine.save_checkpoint(str(staging), tag=TAG, client_state={CLIENT_KEY: client}, save_latest=False)
        files = io.take_records(staging)
        files.update(streamed)
        if self.rank == 0:
            for script in RECOVERY_SCRIPTS:
                if (staging / script).is_file():
                    files[script] = hash_file(staging / script, chunk=1 << 20)  # not an 8 MB buffer on rank 0
        name = local_file(self.rank)
        files[name] = write_file(staging / name, lambda f: _save(local, f))
        return files

    def read(self, path: Path, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]) -> bool:
        holder = states.get("engine")
        if not isinstance(holder, EngineState):
            raise CheckpointError(
                f"checkpoint {path} was written by the DeepSpeed engine: continue it with stack=deepspeed, or load its "
                f"weights only with --pretrained {path}"
            )
        written = read_manifest(path).get("world_size")
        if written == self.world_size:
            client = self._load_engine(path, holder.engine)
        else:  # ZeRO partitions by rank: another world size loads DeepSpeed's universal form of the checkpoint
            self._universal = UniversalSource(path, TAG, self.rank)
            client = self._load_engine(self._universal.locate(self.world_size), holder.engine, universal=True)
        _check_same_settings(path, client.get("ds_config") if isinstance(client, dict) else None, holder.engine)
        replicated = client.get(CLIENT_KEY) if isinstance(client, dict) else None
        if not isinstance(replicated, dict):
            raise CheckpointError(f"checkpoint {path}/{TAG} holds no perdure state in its client_state")
        for key, state in states.items():  # the mapping's order is the restore order; the engine is loaded already
            if key != "engine" and key in replicated:
                value = replicated[key]
                if isinstance(state, StreamedState) and isinstance(value, dict) and STREAMED_FILE in value:
                    state.load_tensors(value, _streamed_file(path, key, value[STREAMED_FILE]))
                else:  # a StreamedState saved whole before (its state_dict) loads as such
                    state.load_state_dict(value)
        return read_local_states(path, self.rank, local_states)

    def _load_engine(self, path: Path, engine: Any, universal: bool = False) -> dict[str, Any]:
        """`engine.load_checkpoint` of the tag, every file read through the allow-list (a universal checkpoint's
        files were checked by `UniversalSource.locate`); its client_state."""
        from perdure.checkpoints.deepspeed_io import recording_io

        recording_io(engine)
        check_tag_dir(path / TAG)
        set_load_universal_checkpoint(engine, universal)  # read by load_checkpoint only, for this one load
        try:
            with deepspeed_loads_restricted():  # a universal load torch.loads zero/<param>/*.pt by name itself
                load_path, client = engine.load_checkpoint(
                    str(path), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False
                )
        except CheckpointError:
            raise
        except pickle.UnpicklingError as error:
            raise deepspeed_refusal(path / TAG, error) from None
        except Exception as error:
            raise CheckpointError(
                f"DeepSpeed could not load checkpoint {path}: {type(error).__name__}: {error}"
            ) from error
        finally:
            set_load_universal_checkpoint(engine, False)
        if load_path is None:  # DeepSpeed only warns when it finds nothing; perdure never goes on from nothing
            raise CheckpointError(f"DeepSpeed found no engine checkpoint in {path / TAG}")
        return client


def _streamed_file(path: Path, key: str, name: Any) -> Path:
    """The file of a `StreamedState` named in a checkpoint's client_state: `<key>.pth` in the checkpoint
    directory, nothing else."""
    if name != f"{key}.pth":
        raise CheckpointError(f"checkpoint {path} names {name!r} as the file of its {key!r} state, not {key}.pth")
    return Path(path) / name


def read_streamed(path: Path, mmap: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a `StreamedState`'s file, read through the allow-list (`mmap`: mapped, not read)."""
    content = load_torch_file(path, mmap=mmap)
    if not isinstance(content, dict) or not all(
        isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in content.items()
    ):
        raise CheckpointError(f"{path} does not hold a dict of tensors")
    return content


# Settings that may differ between a checkpoint and the run continuing it: the global batch follows the world size.
CHANGEABLE_SETTINGS = ("train_batch_size",)
SHOWN = 5


def _check_same_settings(path: Path, stored: Any, engine: Any) -> None:
    """The engine settings a checkpoint was trained with (DeepSpeed stores them in it) against this engine's.

    A run's identity holds `deepspeed.config` as given, so for a file its path, not its content: a file edited between
    a save and a resume would otherwise change the maths of the run it continues without a word.
    """
    from perdure.config import flatten

    current = engine.config
    if not isinstance(stored, dict) or not isinstance(current, dict):
        return
    theirs, ours = flatten(stored), flatten(current)
    changed = sorted(key for key in theirs.keys() | ours.keys() if theirs.get(key) != ours.get(key))
    changed = [key for key in changed if key not in CHANGEABLE_SETTINGS]
    if changed:
        shown = ", ".join(f"{key}: {theirs.get(key)!r} -> {ours.get(key)!r}" for key in changed[:SHOWN])
        more = f" (and {len(changed) - SHOWN} more)" if len(changed) > SHOWN else ""
        raise CheckpointError(
            f"checkpoint {path} was trained with other DeepSpeed settings than this run's: {shown}{more}. The file "
            "given as deepspeed.config changed since: restore it to continue this run, or start a new run from the "
            f"checkpoint's weights (--workspace.id <new id> --pretrained {path})"
        )


def read_deepspeed_weights(path: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """Model (or EMA) weights of a DeepSpeed checkpoint directory, in this process alone (no engine, no ranks).

    ZeRO 1-3: the fp32 master weights, gathered from every rank's optimizer partition by DeepSpeed's zero-to-fp32
    routine; ZeRO-0: the module's weights (in the training precision). EMA: perdure's shadow from the client_state.
    """
    from perdure.checkpoints.safe_unpickle import load_deepspeed_file
    from perdure.distributed.deepspeed_env import import_deepspeed

    tag_dir = Path(path) / TAG
    files = check_engine_files(tag_dir)
    model_files = [file for file in files if file.name.endswith("_model_states.pt")]
    if not model_files:
        raise CheckpointError(f"{tag_dir} holds no DeepSpeed model states file; it is not a DeepSpeed checkpoint")
    first = min(model_files, key=lambda file: (len(file.name), file.name))  # rank 0's: mp_rank_00 or zero_pp_rank_0
    if ema:
        client = load_deepspeed_file(first).get(CLIENT_KEY) or {}
        if isinstance(client.get("ema"), dict) and STREAMED_FILE in client["ema"]:  # written tensor by tensor
            return read_streamed(_streamed_file(Path(path), "ema", client["ema"][STREAMED_FILE]))
        shadow = client.get("ema", {}).get("shadow") if isinstance(client.get("ema"), dict) else None
        if not isinstance(shadow, dict):
            raise CheckpointError(f"checkpoint {path} holds no EMA weights (it was trained with ema.enabled=false)")
        return shadow
    if not any(file.name.endswith("_optim_states.pt") for file in files):  # ZeRO-0: the module holds everything
        module = load_deepspeed_file(first).get("module")
        if not isinstance(module, dict):
            raise CheckpointError(f"{first} holds no module weights")
        return dict(module)
    import_deepspeed()
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # its progress
            with deepspeed_loads_restricted():
                weights = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=TAG)
    except pickle.UnpicklingError as error:
        raise deepspeed_refusal(tag_dir, error) from None
    except Exception as error:
        raise CheckpointError(f"cannot gather the weights of {path}: {type(error).__name__}: {error}") from error
    return {name: tensor.clone() for name, tensor in weights.items()}  # each its own storage, not a flat group's view


register_format(
    WeightsFormat(
        DeepSpeedCheckpointManager.backend,
        read=lambda location, ema, mmap: read_deepspeed_weights(location.info.path, ema=ema),
        manager=DeepSpeedCheckpointManager,
    )
)
