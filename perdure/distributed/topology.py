"""Topology: named parallel axes, the device mesh they span, and which ranks reduce together.

    parallel.axes.{replicate, shard, tensor, pipeline, context, expert}

Each axis is a number of ranks; their product is the world size (one axis may be -1: it takes what the others leave).
Ranks are laid out row-major over the axes in `MESH_ORDER` (the pipeline outermost, the tensor axis innermost, so
tensor-parallel peers are neighbours: on GPUs, the same node), as `init_device_mesh` lays them out.

Who does what along each axis:

    replicate, shard   the data axes: their ranks read different batches (data domain); FSDP keeps the parameters
                       replicated over `replicate` and sharded over `shard` (HSDP when both are > 1)
    tensor, expert     model-parallel axes: their ranks read the same batches and draw the same random stream (dropout
                       on a replicated activation must agree); the model's `parallelize(mesh)` decides what they split
    context            like tensor (same batches, same stream), but every rank holds a part of each sequence, so its
                       gradients and losses are summed with the data axes' (FSDP shards over shard x context)
    pipeline           each rank holds some stages of the model; its own random stream

Reduction domains: data = replicate x shard (the sampler's ranks), loss = replicate x shard x context (whose losses
average into the global loss), optimizer = every rank (the gradient norm and the non-finite skip are agreed there).

Pure: this module computes coordinates and names; only `device_mesh` touches torch.distributed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from perdure.config_checks import SectionKey, register_section, register_stack
from perdure.errors import ConfigError

AXES = ("replicate", "shard", "tensor", "pipeline", "context", "expert")  # the config's order
MESH_ORDER = ("pipeline", "replicate", "shard", "context", "expert", "tensor")  # outermost first
DATA_AXES = ("replicate", "shard")
MODEL_AXES = ("tensor", "context", "expert")  # ranks along them read the same batches and draw the same stream
LOSS_AXES = ("replicate", "shard", "context")
FSDP_AXES = ("replicate", "shard", "context")  # gradients are reduced over these (replicate: HSDP's outer dimension)
# The device mesh names its dimensions as TorchTitan's ParallelDims does, so a model's own plan written for TorchTitan
# (`mesh["tp"]`, ...) runs unchanged; the config keeps the axis names.
MESH_NAMES = {"pipeline": "pp", "replicate": "dp_replicate", "shard": "dp_shard", "context": "cp", "expert": "ep"}
MESH_NAMES["tensor"] = "tp"
FSDP_CONTEXT_MESH = "dp_shard_cp"  # dp_shard x cp flattened (TorchTitan's name), what FSDP shards over when cp > 1
KEY = "parallel.axes"
DEFAULTS = {"replicate": 1, "shard": -1, "tensor": 1, "pipeline": 1, "context": 1, "expert": 1}  # SECTION's (below)
PIPELINE_SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


@dataclass(frozen=True)
class Topology:
    """Axis sizes (each >= 1, product = world size). Build it with `Topology.resolve`."""

    replicate: int = 1
    shard: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    expert: int = 1

    @classmethod
    def resolve(cls, axes: Mapping[str, Any], world_size: int) -> Topology:
        """The topology of `parallel.axes` on `world_size` ranks (axes left out take their defaults: shard -1, the
        others 1); a ConfigError naming the axes, their product and the world size when they do not fit."""
        check_axes(axes)
        sizes = {axis: axes.get(axis, DEFAULTS[axis]) for axis in AXES}
        free = [axis for axis, size in sizes.items() if size == -1]
        fixed = math.prod(size for size in sizes.values() if size != -1)
        shown = ", ".join(f"{axis}={size}" for axis, size in sizes.items())
        if free:
            if world_size % fixed:
                raise ConfigError(
                    KEY,
                    shown,
                    f"the fixed axes multiply to {fixed}, which does not divide the world size {world_size}, so "
                    f"{KEY}.{free[0]}=-1 cannot take the rest; choose axes whose product is {world_size}",
                )
            sizes[free[0]] = world_size // fixed
        elif fixed != world_size:
            raise ConfigError(
                KEY,
                shown,
                f"the axes multiply to {fixed} but the world size is {world_size}; choose axes whose product is "
                f"{world_size}, or set one of them to -1 to take the rest",
            )
        return cls(**sizes)

    # ---- sizes --------------------------------------------------------------------------------------------------

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    @property
    def world_size(self) -> int:
        return math.prod(self.size(axis) for axis in AXES)

    def sizes(self) -> dict[str, int]:
        """Every axis and its size, in the config's order (what a manifest records)."""
        return {axis: self.size(axis) for axis in AXES}

    @property
    def data_size(self) -> int:
        """Ranks that read different batches (replicate x shard): the sampler's world size."""
        return self.replicate * self.shard

    @property
    def model_parallel(self) -> bool:
        """Whether the model itself must be split (tensor, context or expert > 1)."""
        return any(self.size(axis) > 1 for axis in MODEL_AXES)

    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The device mesh's dimensions (axis, size), outermost first: the data axes always, others when > 1 (the
        mesh names them `MESH_NAMES[axis]`)."""
        return tuple((axis, self.size(axis)) for axis in MESH_ORDER if axis in DATA_AXES or self.size(axis) > 1)

    def describe(self) -> str:
        """e.g. `shard 2 x tensor 2 (4 ranks)`: the axes > 1, in the mesh's order."""
        used = [f"{axis} {self.size(axis)}" for axis in MESH_ORDER if self.size(axis) > 1]
        ranks = self.world_size
        return f"{' x '.join(used) or 'shard 1'} ({ranks} rank{'' if ranks == 1 else 's'})"

    # ---- where a rank sits --------------------------------------------------------------------------------------

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank `rank`'s position along every axis (0 along axes of size 1)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the topology {self.describe()}")
        position: dict[str, int] = {}
        for axis in reversed(MESH_ORDER):
            rank, position[axis] = divmod(rank, self.size(axis))
        return {axis: position[axis] for axis in AXES}

    def rank_at(self, coordinates: Mapping[str, int]) -> int:
        """The rank at a position (axes left out are 0)."""
        rank = 0
        for axis in MESH_ORDER:
            index = coordinates.get(axis, 0)
            if not 0 <= index < self.size(axis):
                raise ValueError(f"position {axis}={index} is outside the topology {self.describe()}")
            rank = rank * self.size(axis) + index
        return rank

    def data_rank(self, rank: int) -> int:
        """Which share of the data rank `rank` reads (0 .. data_size - 1): replicate-major, as the sampler counts."""
        position = self.coordinates(rank)
        return position["replicate"] * self.shard + position["shard"]

    def stage(self, rank: int) -> int:
        """Rank `rank`'s position along the pipeline axis."""
        return self.coordinates(rank)["pipeline"]

    def stream_index(self, rank: int) -> int:
        """The index of rank `rank`'s random stream: equal for ranks that differ only along the model-parallel axes
        (tensor, context, expert), distinct otherwise; rank 0's is 0 (the stream of a single-process run)."""
        position = self.coordinates(rank)
        return (position["pipeline"] * self.replicate + position["replicate"]) * self.shard + position["shard"]

    def stream_leader(self, rank: int) -> int:
        """The rank with the same stream as `rank` and position 0 along the model-parallel axes."""
        return self.rank_at({**self.coordinates(rank), **dict.fromkeys(MODEL_AXES, 0)})

    def peers(self, rank: int, axes: tuple[str, ...]) -> list[int]:
        """The ranks that differ from `rank` only along `axes` (a reduction domain), in rank order."""
        position = self.coordinates(rank)
        ranks = [
            candidate
            for candidate in range(self.world_size)
            if all(self.coordinates(candidate)[axis] == position[axis] for axis in AXES if axis not in axes)
        ]
        return ranks

    def local_source(self, rank: int, before: Topology) -> int | None:
        """Whose rank-local state (RNG, iterable data position) rank `rank` continues after a restore written under
        topology `before`: itself when nothing changed; else the rank of `before` at the same data rank and pipeline
        stage, at position 0 of the model-parallel axes (whose ranks shared one stream). None when `before` had no
        such rank (more data ranks or stages now): that rank's streams are seeded afresh."""
        if before == self:
            return rank
        position = self.coordinates(rank)
        data, stage = self.data_rank(rank), position["pipeline"]
        if data >= before.data_size or stage >= before.pipeline:
            return None
        replicate, shard = divmod(data, before.shard)
        return before.rank_at({"replicate": replicate, "shard": shard, "pipeline": stage})

    def to_manifest(self) -> dict[str, int]:
        return self.sizes()

    @classmethod
    def from_manifest(cls, record: Any) -> Topology | None:
        """The topology a manifest recorded, or None (no record, or not a valid one: the manifest is someone else's)."""
        if not isinstance(record, Mapping) or set(record) != set(AXES):
            return None
        if not all(type(record[axis]) is int and 1 <= record[axis] <= 1 << 20 for axis in AXES):
            return None
        return cls(**{axis: record[axis] for axis in AXES})


def check_axes(axes: Mapping[str, Any]) -> None:
    """`parallel.axes` without the world size: known axes, integers >= 1 or -1, at most one -1."""
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise ConfigError(f"{KEY}.{unknown[0]}", axes[unknown[0]], f"unknown axis; the axes are {', '.join(AXES)}")
    for axis, size in axes.items():
        if type(size) is not int or not (size >= 1 or size == -1):
            raise ConfigError(f"{KEY}.{axis}", size, "use a number of ranks >= 1, or -1 to take the rest")
    free = [axis for axis, size in axes.items() if size == -1]
    if len(free) > 1:
        shown = ", ".join(f"{axis}=-1" for axis in free)
        raise ConfigError(
            KEY, shown, f"at most one axis may be -1 (it takes the ranks the others leave); give {free[1]} a size"
        )


def check_parallel_section(config: Any, get: Callable[[str], Any]) -> None:
    """`parallel.*` as far as it can be checked without the world size (`Topology.resolve` does the rest)."""
    parallel = get("parallel") or {}
    check_axes(parallel.get("axes", {}))
    pipeline = parallel.get("pipeline", {})
    schedule, virtual = pipeline.get("schedule"), pipeline.get("virtual_stages")
    if schedule == "Interleaved1F1B" and virtual < 2:
        fix = "Interleaved1F1B runs 2 or more stages per rank; use 2 or more, or the 1F1B schedule"
        raise ConfigError("parallel.pipeline.virtual_stages", virtual, fix)
    if schedule != "Interleaved1F1B" and virtual != 1:
        fix = f"{schedule} runs one stage per rank; use 1, or --parallel.pipeline.schedule Interleaved1F1B"
        raise ConfigError("parallel.pipeline.virtual_stages", virtual, fix)


# stack=parallel (docs/parallel.md). Ranks per axis; their product is the world size, one may be -1 (the rest).
SECTION = (
    SectionKey("axes.replicate", DEFAULTS["replicate"], "whole-model replicas (HSDP's outer dimension)"),
    SectionKey(
        "axes.shard", DEFAULTS["shard"], "FSDP2 shards of parameters, gradients and optimizer state; -1: the rest"
    ),
    SectionKey("axes.tensor", DEFAULTS["tensor"], "tensor parallelism (the model's tensor plan over this many ranks)"),
    SectionKey("axes.pipeline", DEFAULTS["pipeline"], "pipeline stages (the model's pipeline split)"),
    SectionKey(
        "axes.context", DEFAULTS["context"], "context parallelism (the model's parallelize(mesh) splits sequences)"
    ),
    SectionKey("axes.expert", DEFAULTS["expert"], "expert parallelism (the model's parallelize(mesh) places experts)"),
    SectionKey("pipeline.schedule", "1F1B", "1F1B, GPipe or Interleaved1F1B", choices=PIPELINE_SCHEDULES),
    SectionKey("pipeline.microbatches", None, "microbatches per batch; None: one per stage", count=(1, True)),
    SectionKey("pipeline.virtual_stages", 1, "stages per rank (Interleaved1F1B: 2 or more)", count=(1, False)),
    SectionKey(
        "fsdp.offload", False, "keep sharded parameters, gradients and optimizer state on the CPU", boolean=True
    ),
    SectionKey("fsdp.reshard_after_forward", True, "free gathered parameters after each block's forward", boolean=True),
    SectionKey("activation_checkpointing", False, "recompute each block's activations in the backward", boolean=True),
    SectionKey(
        "loss_parallel", False, "tensor parallel: the loss on vocabulary-sharded logits (no gather)", boolean=True
    ),
)
register_stack("parallel", "perdure.runners.parallel_runner:ParallelRunner")
# The parallel layout is no part of the run's config identity (workspace/identity.py): the topology (`parallel.axes`,
# like the world size) so a run continues on another topology; how a pipeline runs (`parallel.pipeline`: the schedule
# only reorders microbatches, whose gradients are summed in the same order by every schedule; the number of
# microbatches only splits the batch into equal parts whose mean losses average to the batch's, changing rounding as a
# change of world size does); FSDP's memory knobs and activation checkpointing (recomputation with the random state
# restored: the same values).
NOT_IDENTITY = (
    "parallel.axes",
    "parallel.pipeline",
    "parallel.fsdp",
    "parallel.activation_checkpointing",
    "parallel.loss_parallel",
)
register_section("parallel", SECTION, check_parallel_section, not_identity=NOT_IDENTITY)


def device_mesh(topology: Topology, device_type: str) -> Any:
    """The DeviceMesh of `topology`, its dimensions named as TorchTitan names them (`MESH_NAMES`: `mesh["tp"]`,
    `mesh["pp"]`, `mesh["dp_shard"]`, ...), plus `dp_shard_cp` (dp_shard x cp flattened, what FSDP shards over) when
    context > 1. Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    from perdure.private_api import flatten_mesh_dims

    axes, sizes = zip(*topology.mesh_dims())
    mesh = init_device_mesh(device_type, sizes, mesh_dim_names=tuple(MESH_NAMES[axis] for axis in axes))
    if topology.context > 1:
        flatten_mesh_dims(mesh, ("dp_shard", "cp"), FSDP_CONTEXT_MESH)
    return mesh
