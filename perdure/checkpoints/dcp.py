"""DCPCheckpointManager: model, optimizer and EMA through torch.distributed.checkpoint (DCP), so a checkpoint reshards.

A checkpoint directory holds

    .metadata              DCP's index of every tensor and object (rank 0)
    __{r}_0.distcp         DCP shards: rank r's share of model / optimizer / EMA (DCP spreads replicated tensors
                           over the ranks, each tensor written once)
    replicated.pth         plain-data replicated state: RunnerState, scheduler, grad scaler, ... (rank 0, torch.save)
    rank{r:05d}.pth        rank-local state: RNGs and data position (every rank, torch.save)
    config.yaml            and manifest.json, as with every backend

The model goes through its own `state_dict()` / `load_state_dict()` (`module_state.py`: its hooks renaming or fusing
tensors apply, as in every backend), the optimizer through `get_optimizer_state_dict` (FQN-keyed, the standard DCP
format), so a checkpoint written by N ranks loads on M ranks: every rank reads what its tensors need. Plain data goes
into one small file instead of DCP's per-object entries because its structure changes as training goes on (results
history, pending losses), and DCP only fills keys the loading side already has. Each rank hashes the files it wrote and
hands the records to the one commit protocol (`CheckpointManager.commit_job`, `gather.py`).

Async saves (`ckpt.async_mode`): the training loop only snapshots (copies) the state; perdure's writer thread then calls
`dcp.async_save` (THREAD, or PROCESS: DCP's own background process per rank) on a dedicated gloo group, waits for it,
hashes, publishes its records, and on rank 0 commits. The writer threads of all ranks run the same saves in the same
order: a queued plain save is dropped only when every rank agrees (see `AsyncSaver.make_room`). A single process
(world size 1) uses the writer thread or perdure's writer process with a local `dcp.save`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from perdure.checkpoints.async_save import AsyncSaver, _raise_open_file_limit
from perdure.checkpoints.base import CheckpointManager, Stateful
from perdure.checkpoints.commit import FileRecord, hash_file, read_manifest, write_file
from perdure.checkpoints.dcp_process import replace_after_failure
from perdure.checkpoints.dcp_slices import DCPSlices
from perdure.checkpoints.file import local_file, read_local_states
from perdure.checkpoints.module_state import load_module_state_dict, module_state_dict
from perdure.checkpoints.read import WeightsFormat, WeightsLocation, register_format
from perdure.checkpoints.safe_dcp import RestrictedFileSystemReader, RestrictedLoadPlanner, read_dcp_metadata
from perdure.checkpoints.safe_unpickle import load_torch_file
from perdure.checkpoints.save_errors import save_failure
from perdure.errors import CheckpointCorruptError, CheckpointError

logger = logging.getLogger("perdure")

# Replicated objects whose tensors go through DCP; every other replicated object is plain data in REPLICATED_FILE.
DCP_KEYS = ("model", "optimizer", "ema")
REPLICATED_FILE = "replicated.pth"
METADATA_FILE = ".metadata"

# DCP warns on every save / load without a process group that it assumes a single process: intended here (world size 1,
# and weights read by one rank). A filter, not `catch_warnings`, which is not thread-safe (the writer thread saves).
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized", category=UserWarning
)


def shard_files(staging: Path, rank: int) -> list[Path]:
    """The DCP data files rank `rank` wrote (`__{rank}_{i}.distcp`)."""
    return sorted(staging.glob(f"__{rank}_*.distcp"))


class DCPCheckpointManager(CheckpointManager):
    """Collective: every rank enters `save` and `load` together. See the module docstring for the layout."""

    backend = "dcp"
    collective = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The background writers' own gloo group: DCP's collectives there never interleave with training's.
        self._group: dist.ProcessGroup | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_group"] = None
        return state

    # ---- what goes in -------------------------------------------------------------------------------------------

    def snapshot_states(
        self, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer in DCP's keyed form (`module_state_dict` / `get_optimizer_state_dict`); their
        tensors are the live ones, so an async snapshot still copies parameters and optimizer state late. A model
        that is not an `nn.Module` is a Stateful that gives its DCP form itself (the parallel stack's sharded
        model and optimizer), and so is its optimizer."""
        model = states.get("model")
        module = model if isinstance(model, nn.Module) else None
        replicated: dict[str, Any] = {}
        for key, state in states.items():
            if key == "model" and module is not None:
                replicated[key] = module_state_dict(module)  # `module` is `state`
            elif key == "optimizer" and module is not None:
                # Beside an nn.Module model, the optimizer is a torch optimizer (the Stateful kind comes in pairs).
                replicated[key] = get_optimizer_state_dict(module, cast(torch.optim.Optimizer, state))
            else:
                replicated[key] = state.state_dict()
        return replicated, {key: state.state_dict() for key, state in local_states.items()}

    # ---- async: the background group and writer -----------------------------------------------------------------

    def _async_saver(self) -> AsyncSaver:
        # Called on every rank at the same point (training start, or the first save): new_group is collective.
        if self._saver is None:
            if self.world_size > 1:
                self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
                if self.policy.async_mode == "process":
                    _raise_open_file_limit()  # snapshot tensors travel to DCP's process as file descriptors
            # With several ranks DCP's own executor does the thread / process work; perdure's writer process is only
            # used by a single process (its `dcp.save` needs no process group).
            mode = "thread" if self.world_size > 1 else self.policy.async_mode
            # DCP's process receives the snapshot without another copy when its buffers are shared memory.
            shared = self.policy.async_mode == "process"
            staging = self.policy.device_staging
            self._saver = AsyncSaver(self, mode, shared_memory=shared, device_staging=staging, watch=self.watch)
        return self._saver

    # ---- the backend --------------------------------------------------------------------------------------------

    def write(self, staging: Path, replicated: dict[str, Any], local: dict[str, Any]) -> dict[str, FileRecord]:
        tensors = {key: value for key, value in replicated.items() if key in DCP_KEYS}
        plain = {key: value for key, value in replicated.items() if key not in DCP_KEYS}
        # DCP first: it is collective, so a rank that fails before it would keep the others waiting in it.
        self._dcp_save(tensors, staging)
        files: dict[str, FileRecord] = {}
        own = shard_files(staging, self.rank) + ([staging / METADATA_FILE] if self.rank == 0 else [])
        for path in own:
            files[path.name] = hash_file(path)
        if self.rank == 0:
            files[REPLICATED_FILE] = write_file(staging / REPLICATED_FILE, lambda f: torch.save(plain, f))
        name = local_file(self.rank)
        files[name] = write_file(staging / name, lambda f: torch.save(local, f))
        return files

    def _dcp_save(self, state: dict[str, Any], staging: Path) -> None:
        writer = FileSystemWriter(staging, sync_files=True, overwrite=False)
        try:
            if self.world_size == 1:
                with _single_process():
                    dcp.save(state, storage_writer=writer, no_dist=True)
            elif self._group is not None:  # async mode: the writer thread (or the loop after a drain)
                process = self.policy.async_mode == "process"
                kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
                future = dcp.async_save(
                    state,
                    storage_writer=writer,
                    process_group=self._group,
                    async_checkpointer_type=kind,
                    async_stager=_AlreadyStaged(),
                )
                assert isinstance(future, Future)  # `_AlreadyStaged.stage` returns no future: DCP gives the upload one
                future.result()
            else:
                dcp.save(state, storage_writer=writer)
        except (Exception, CheckpointException) as error:  # CheckpointException is a BaseException
            # DCP reports a failure on any rank to every rank, so all of them fail this save together.
            reported: BaseException = error
            if self._group is not None and self.policy.async_mode == "process":
                reported = replace_after_failure(error, self.rank)
            raise save_failure(reported, name=staging.name, root=staging.parent) from error

    def read(self, path: Path, states: Mapping[str, Stateful], local_states: Mapping[str, Stateful]) -> bool:
        model, optimizer = states.get("model"), states.get("optimizer")
        files = _manifest_files(path)
        stored = {key.split(".", 1)[0] for key in read_dcp_metadata(path, files).state_dict_metadata}
        # Templates shaped like this run's objects (on this world size); DCP fills them from whatever ranks wrote.
        template: dict[str, Any] = {}
        if isinstance(model, nn.Module) and "model" in stored:
            template["model"] = module_state_dict(model)
            if optimizer is not None and "optimizer" in stored:
                template["optimizer"] = get_optimizer_state_dict(model, cast(torch.optim.Optimizer, optimizer))
        for key in DCP_KEYS:
            if key in states and key in stored and key not in template:
                template[key] = states[key].state_dict()
        try:
            _restricted_load(template, path, files, no_dist=self.world_size == 1)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as error:
            raise CheckpointError(f"DCP could not read checkpoint {path}: {_describe(error)}") from error
        plain = load_torch_file(path / REPLICATED_FILE)
        module = model if isinstance(model, nn.Module) else None
        for key, state in states.items():  # the mapping's order is the restore order
            if key == "model" and key in template and module is not None:
                load_module_state_dict(module, template[key])
            elif key == "optimizer" and key in template and module is not None:
                set_optimizer_state_dict(module, cast(torch.optim.Optimizer, optimizer), template[key])
            elif key in template:
                state.load_state_dict(template[key])
            elif key in plain:
                state.load_state_dict(plain[key])
        source = self.local_source(path)
        return source is not None and read_local_states(path, source, local_states)

    def local_source(self, path: Path) -> int | None:
        """Whose rank-local file (RNGs, data position) this rank reads from checkpoint `path`: its own rank; a
        backend that knows a topology may map it to another rank, or to None (none fits: streams start afresh)."""
        return self.rank


def _restricted_load(state: dict[str, Any], path: Path, files: dict[str, Any] | None, *, no_dist: bool) -> None:
    """`dcp.load` through the allow-listed reader and planner (see `safe_dcp.py`): nothing in the checkpoint
    can run code. A refusal inside DCP (which wraps errors in CheckpointException) surfaces as the CheckpointError."""
    reader = RestrictedFileSystemReader(path, files)
    try:
        with _single_process():
            dcp.load(state, storage_reader=reader, planner=RestrictedLoadPlanner(path), no_dist=no_dist)
    except CheckpointException as error:
        refusals = [e[0] for e in error.failures.values() if isinstance(e[0], CheckpointError)]
        if refusals:
            raise refusals[0] from None
        raise


def _manifest_files(path: Path) -> dict[str, Any] | None:
    """The manifest's file list of a checkpoint, for bounding what DCP metadata may point at (None: no manifest)."""
    try:
        return read_manifest(path)["files"]
    except CheckpointCorruptError:
        return None


@contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process whenever no process group exists: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def read_dcp_weights(path: Path, ema: bool = False) -> dict[str, torch.Tensor]:
    """Model (or EMA) weights of a DCP checkpoint directory, read in this process alone (no process group needed)."""
    prefix = "ema.shadow." if ema else "model."
    try:
        files = _manifest_files(path)
        weights = {
            key[len(prefix) :]: torch.empty(item.size, dtype=item.properties.dtype)
            for key, item in read_dcp_metadata(path, files).state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
        }
        if weights:
            nested: dict[str, Any] = {"ema": {"shadow": weights}} if ema else {"model": weights}
            _restricted_load(nested, path, files, no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as error:  # a BaseException must not bypass the runner's error handling
        raise CheckpointError(f"cannot read weights from DCP checkpoint {path}: {_describe(error)}") from error
    if not weights:
        what = "EMA weights (it was trained with ema.enabled=false)" if ema else "model weights"
        raise CheckpointError(f"DCP checkpoint {path} holds no {what}")
    return weights


class _AlreadyStaged(AsyncStager):
    """perdure's Snapshot already copied the state off the live tensors: DCP writes it as is, without a second copy."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _describe(error: BaseException) -> str:
    """One line for a save failure; a CheckpointException names the ranks and their own errors."""
    if isinstance(error, CheckpointException):
        failures = ", ".join(f"rank {rank}: {type(e[0]).__name__}: {e[0]}" for rank, e in error.failures.items())
        return f"DCP failed on {failures}"
    return f"{type(error).__name__}: {error}"


def _open_dcp_slices(location: WeightsLocation, ema: bool) -> DCPSlices:
    """The weights of a DCP checkpoint, opened from its metadata: each region read from the chunks it overlaps."""
    return DCPSlices(location.path, location.info.path, location.info.manifest.get("files"), ema)


register_format(
    WeightsFormat(
        DCPCheckpointManager.backend,
        read=lambda location, ema, mmap: read_dcp_weights(location.info.path, ema=ema),
        open_slices=_open_dcp_slices,
        manager=DCPCheckpointManager,
    )
)
