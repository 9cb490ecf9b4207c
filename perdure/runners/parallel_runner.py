"""ParallelRunner: FSDP2, tensor and pipeline parallelism on one named DeviceMesh (`stack=parallel`).

    __init__            the process group (also for a single process), the topology from `parallel.axes`, and every
                        check of the configuration (a ConfigError before anything is written)
    distribute_model    the user's whole model, optimizer, scheduler and EMA become this rank's share:
                          split into pipeline stages (`split_pipeline`)
                          -> per stage: model parallelism (`parallelize_model`: the model's `parallelize(mesh)`)
                          -> activation checkpointing -> compile (per block) -> FSDP2 (per block, then the stage)
                          -> the optimizer rebuilt over the new parameters (found through the module tree), the
                             scheduler rebound, the EMA rebuilt (sharded like the model)
    the loop            BaseRunner's: `forward_backward` runs the pipeline schedule when there is one; gradient
                        clipping takes the norm over the whole mesh; the non-finite skip is agreed by every rank
    checkpoints         DCP (`ParallelCheckpointManager`): FQN-keyed shards of model, optimizer and EMA, every rank
                        entering, the topology in the manifest; a checkpoint loads on any topology
    export              `model.pth` with the whole model's full weights, gathered to rank 0

Random streams: ranks that differ only along the model-parallel axes (tensor, context, expert) draw the same stream;
every data rank and pipeline stage draws its own (`Topology.stream_index`). The data position is kept per data rank.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from perdure.checkpoints.base import CheckpointManager, Stateful
from perdure.checkpoints.module_state import module_state_dict
from perdure.checkpoints.read import open_weight_slices
from perdure.checkpoints.resolve import CheckpointInfo
from perdure.checkpoints.sharded import ParallelCheckpointManager, ShardedModel, ShardedOptimizer
from perdure.checkpoints.source import RestoreSource
from perdure.checkpoints.weights_slices import WeightSlices
from perdure.distributed.collectives import all_gather_object
from perdure.distributed.grad_norm import clip_grad_norm
from perdure.distributed.process_group import init_process_group, select_backend
from perdure.distributed.topology import FSDP_CONTEXT_MESH, Topology, device_mesh
from perdure.errors import ConfigError, PerdureError
from perdure.private_api import compiled_original
from perdure.runners.compile import is_compiled, uncompiled
from perdure.runners.ema import ExponentialMovingAverage
from perdure.runners.export import StreamSource, module_source
from perdure.runners.hf_export import (
    distinct,
    export_dtype,
    hooks_make_tensors,
    stream_adapted,
    stream_weights,
    tied_keys,
    untied,
    write_with_dcp,
)
from perdure.runners.loss_parallel import local_loss, loss_context
from perdure.runners.meta_init import check_initialisable, is_meta_model
from perdure.runners.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    apply_model_parallel,
    find_blocks,
    mesh_misuse_hints,
    mixed_precision_policy,
)
from perdure.runners.pipeline import (
    ModelParts,
    Pipeline,
    PositionOnly,
    check_cover,
    check_microbatches,
    split_model,
    stage_indices,
)
from perdure.runners.pretrained_shards import describe_reads, load_shards, plan_pretrained
from perdure.runners.rebind import parameter_slots, rebind_scheduler, rebuild_optimizer
from perdure.runners.torch_runner import NO_CONTEXT, TorchRunner


class ParallelRunner(TorchRunner):
    """FSDP2 x tensor x pipeline parallelism; see the module docstring and docs/parallel.md."""

    checkpoint_manager_class = ParallelCheckpointManager

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        # DTensor warns at every multi-step redistribution (a 2-D norm, a 2-D gather for the export) that it could be
        # faster on a flattened mesh: advice for torch, not for the user; the runner agrees such values itself.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        self.mesh: Any = None  # the DeviceMesh, built in `distribute_model`
        self.model_parts: list[nn.Module] = []  # this rank's stages (one without a pipeline)
        self.pipeline: Pipeline | None = None

    # ---- process group, topology and the checks made before anything is written ---------------------------------

    def init_distributed(self) -> tuple[int, int]:
        """Join the process group (a single process gets a group of its own: the device mesh needs one), resolve the
        topology and check the configuration against it."""
        rank, world_size = init_process_group(self.config.dist.backend, self.config.dist.timeout)
        if not dist.is_initialized():
            store = dist.HashStore()
            dist.init_process_group(select_backend(self.config.dist.backend), store=store, rank=0, world_size=1)
        self.topology = Topology.resolve(self.config.parallel.axes, world_size)
        self.check_parallel_config()
        return rank, world_size

    def check_parallel_config(self) -> None:
        """Called in `__init__` once the topology is known, before anything is written: refuse what this stack
        cannot run, naming the key and the fix."""
        config, topology = self.config, self.topology
        if config.ckpt.backend not in ("auto", "dcp"):
            fix = "the parallel stack saves sharded state through DCP (reshardable); use auto or dcp"
            raise ConfigError("ckpt.backend", config.ckpt.backend, fix)
        if config.parallel.fsdp.offload and not torch.cuda.is_available():
            fix = "offloading keeps sharded state on the CPU instead of the GPU; without CUDA it is there already"
            raise ConfigError("parallel.fsdp.offload", True, fix)
        if config.precision == "fp16":
            fix = "the parallel stack has no sharded gradient scaler for fp16; use bf16 (no loss scaling needed)"
            raise ConfigError("precision", "fp16", fix)
        if topology.pipeline == 1:
            return
        if config.loss.normalize == "tokens":
            fix = "the pipeline schedule calls self.criterion, whose loss is a mean per microbatch; use mean"
            raise ConfigError("loss.normalize", "tokens", fix)
        for method in ("train_step", "evaluate_step"):
            if getattr(type(self), method) is not getattr(ParallelRunner, method):
                raise ConfigError(
                    "parallel.axes.pipeline",
                    topology.pipeline,
                    f"{type(self).__name__} overrides {method}, which pipeline parallelism never calls: the schedule "
                    "runs the stages, and the loss is the criterion's (self.criterion(output, target)) on the last "
                    "stage. Move the loss into self.criterion, or set parallel.axes.pipeline to 1",
                )
        pipeline = config.parallel.pipeline
        check_microbatches(
            pipeline.schedule, self.microbatches(), self.num_stages(), config.loader_options("train")["batch_size"]
        )

    def num_stages(self) -> int:
        return self.topology.pipeline * self.config.parallel.pipeline.virtual_stages

    def microbatches(self) -> int:
        """`parallel.pipeline.microbatches`, or one per stage (the fewest 1F1B runs with)."""
        return self.config.parallel.pipeline.microbatches or self.num_stages()

    def _checkpoint_manager(self, token: str = "") -> CheckpointManager:
        manager = super()._checkpoint_manager(token)
        manager.identity["topology"] = self.topology.to_manifest()  # into every manifest
        return manager

    # ---- where this rank sits --------------------------------------------------------------------------------------

    def random_stream(self) -> int:
        return self.topology.stream_index(self.rank)

    def data_shard(self) -> tuple[int, int]:
        return self.topology.data_rank(self.rank), self.topology.data_size

    # ---- sharding the model ----------------------------------------------------------------------------------------

    def distribute_model(self) -> None:
        """Shard the whole model the user built (see the module docstring for the order), then rebuild the optimizer
        over this rank's parameters, rebind the scheduler and rebuild the EMA."""
        model = self.model
        if is_compiled(model):  # compiled by hand: compile.* applies per block
            model = compiled_original(model)
        slots = parameter_slots(self.optimizer, model)  # where each parameter lives, found again after sharding
        meta = is_meta_model(model)  # built on the meta device: each rank allocates its shards once they are cut
        pretrained = None  # `--pretrained`: names and shapes checked on the whole model, read into the shards below
        if self.restore_source.kind == "pretrained":
            pretrained = plan_pretrained(model, self.checkpointing.take_pretrained(), self.state_dict_adapter())
        self.mesh = device_mesh(self.topology, self.device.type)
        parts = self.split_pipeline(model, self.mesh) if self.topology.pipeline > 1 else [model]
        for part in parts:
            with mesh_misuse_hints(f"{type(self).__name__}.parallelize_model"):
                self.parallelize_model(part, self.mesh)
            self.apply_activation_checkpointing(part)
            self.apply_compile(part)
            apply_fsdp(part, self.model_blocks(part), self.fsdp_mesh(), **self.fsdp_kwargs())
        if meta:
            self.materialise_model(parts)
        if pretrained is not None:  # each rank reads the regions of its shards (`pretrained_shards.py`)
            load_shards(parts, pretrained)
            assert self.restore_source.path is not None  # a pretrained source carries its weights' path
            self.logger.info("%s", describe_reads(pretrained, self.restore_source.path))
        self.model_parts = parts
        self.model = parts[0] if len(parts) == 1 else ModelParts(parts)
        old = self.optimizer
        self.optimizer = rebuild_optimizer(old, slots, parts)
        if self.scheduler is not None:
            rebind_scheduler(self.scheduler, old, self.optimizer)
        if self.ema is not None:
            self.ema = ExponentialMovingAverage(self.model, self.ema.decay)
        if self.topology.pipeline > 1:
            self.pipeline = self._build_pipeline(parts)
        held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in self.model.parameters())
        self.logger.info("parallel: %s; rank 0 holds %d parameter values", self.topology.describe(), held)

    def place_model(self) -> None:
        """As every stack's, except for a model built on the meta device: it stays there (checked that something
        initialises it) until `distribute_model` has sharded it; then each rank allocates and initialises only its
        shards (`materialise_model`)."""
        if not is_meta_model(self.model):
            return super().place_model()
        check_initialisable(self.model)
        if isinstance(self.criterion, nn.Module):
            self.criterion.to(self.device)

    def init_module(self) -> AbstractContextManager:
        """The meta device: the model is built without storage, sharded, then each rank allocates its shards."""
        return torch.device("meta")

    def split_pipeline(self, model: nn.Module, mesh: Any) -> list[nn.Module]:
        """Called in `distribute_model` when `parallel.axes.pipeline` > 1: this rank's stages of the whole model.

        Default: `model.pipeline_stage(stage_index, num_stages)` per stage this rank holds, each checked to keep the
        whole model's parameter names and shapes, and all stages together checked to hold every parameter once. An
        override must keep those names (checkpoints match tensors by them) and must not shard anything.
        """
        position = mesh["pp"].get_local_rank()
        indices = stage_indices(position, self.topology.pipeline, self.config.parallel.pipeline.virtual_stages)
        parts = split_model(model, indices, self.num_stages())
        held = {index: [name for name, _ in part.named_parameters()] for index, part in zip(indices, parts)}
        by_stage: dict[int, list[str]] = {}
        for stages in all_gather_object(held):  # the same on every rank: each stage's names, once per data rank
            by_stage.update(stages)
        check_cover(by_stage, [name for name, _ in model.named_parameters()])
        return parts

    def parallelize_model(self, model: nn.Module, mesh: Any) -> None:
        """Called in `distribute_model` for each stage (the whole model without a pipeline), before activation
        checkpointing, compile and FSDP: apply tensor / context / expert parallelism in place.

        Default: `model.parallelize(mesh)` when any of those axes is > 1; a model without that method is refused with
        a ConfigError, never trained unsplit. The mesh names its dimensions as TorchTitan does (`mesh["tp"]`,
        `mesh["cp"]`, `mesh["ep"]`, `mesh["dp_shard"]`, ...: `perdure.distributed.topology.MESH_NAMES`). Override it to
        call a TorchTitan-style function of your own (e.g. `apply_tp(model, mesh["tp"], loss_parallel=...)`). An
        override must not apply FSDP (the runner does, afterwards); it may wrap modules (the optimizer follows the
        parameters through the module tree).
        """
        apply_model_parallel(model, mesh, self.topology)

    def model_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks of a model or stage, the units of activation checkpointing, compile and FSDP.

        Default: the children of its `layers` or `blocks` container (nn.ModuleDict / nn.ModuleList); none otherwise
        (the model is then one FSDP unit). Must return the same blocks each time it is called.
        """
        return find_blocks(model)

    def apply_activation_checkpointing(self, model: nn.Module) -> None:
        """Called after `parallelize_model`: with `parallel.activation_checkpointing`, recompute each block's
        activations in the backward (the default wraps each block's `forward` in place). Override it to call a model's
        own function (TorchTitan's `apply_ac`: torch's `checkpoint_wrapper` may replace the blocks); an override must
        leave compile and FSDP to the runner."""
        if not self.config.parallel.activation_checkpointing:
            return
        blocks = self.model_blocks(model)
        if not blocks:
            raise ConfigError(
                "parallel.activation_checkpointing",
                True,
                f"{type(model).__name__} has no blocks (a `layers` or `blocks` ModuleDict / ModuleList) to checkpoint; "
                "override ParallelRunner.model_blocks, or set it to false",
            )
        apply_activation_checkpointing(blocks)

    def apply_compile(self, model: nn.Module) -> None:
        """Called after `apply_activation_checkpointing`, before FSDP: with `compile.enabled`, `torch.compile` each
        block in place (`nn.Module.compile`: no parameter is renamed). Override it to call a model's own compile
        function (TorchTitan's `apply_compile`); an override must leave FSDP to the runner."""
        if self.config.compile.enabled:
            apply_compile(self.model_blocks(model), self.config.compile.backend, self.config.compile.mode)

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Options of `fully_shard` for every block and stage: the mixed-precision policy of `precision` (bf16
        parameters and compute, fp32 gradient reduction), CPU offload (`parallel.fsdp.offload`) and
        `parallel.fsdp.reshard_after_forward`. Override to change them; the mesh is the runner's."""
        fsdp = self.config.parallel.fsdp
        return {
            "mp_policy": mixed_precision_policy(self.config.precision),
            "offload": fsdp.offload,
            "reshard_after_forward": fsdp.reshard_after_forward,
        }

    def fsdp_mesh(self) -> Any:
        """The mesh FSDP shards over: the data axes (replicate x shard: HSDP when replicate > 1), with the context
        axis folded into shard (context-parallel ranks hold parts of the same sequences: their gradients sum)."""
        shard = FSDP_CONTEXT_MESH if self.topology.context > 1 else "dp_shard"
        return self.mesh["dp_replicate", shard] if self.topology.replicate > 1 else self.mesh[shard]

    def _build_pipeline(self, parts: list[nn.Module]) -> Pipeline:
        position = self.topology.coordinates(self.rank)
        last = self.topology.rank_at({**position, "pipeline": self.topology.pipeline - 1})
        indices = stage_indices(position["pipeline"], self.topology.pipeline, len(parts))
        return Pipeline(
            parts,
            indices,
            self.num_stages(),
            group=self.mesh["pp"].get_group(),
            last_rank=last,
            device=self.device,
            schedule=self.config.parallel.pipeline.schedule,
            microbatches=self.microbatches(),
            criterion=self.required_criterion(),
        )

    def wrap_model(self) -> None:
        """Nothing left to wrap: `distribute_model` sharded the model before the restore."""

    def build_dataloaders(self) -> None:
        """As every stack's, sharded by data rank; a middle pipeline stage (neither first nor last) reads no samples,
        only their positions, so it keeps and restores the data position of its data rank without loading data."""
        position = self.topology.coordinates(self.rank)["pipeline"]
        if not 0 < position < self.topology.pipeline - 1:
            super().build_dataloaders()
            self._check_last_batch()
            return
        datasets = self.datasets
        self.datasets = {
            split: PositionOnly(dataset) if not isinstance(dataset, torch.utils.data.IterableDataset) else dataset
            for split, dataset in datasets.items()
        }
        try:
            super().build_dataloaders()
        finally:
            self.datasets = datasets

    def _check_last_batch(self) -> None:
        """Under pipeline parallelism every training batch is cut into equal microbatches: refuse, before anything
        is written, an epoch whose last batch cannot be (it would fail when the epoch ends)."""
        loader = self.dataloaders["train"]
        if self.pipeline is None or loader.sampler is None or loader.loader.drop_last:
            return
        last = (loader.sampler.total_size // loader.world_size) % loader.batch_size
        if last % self.microbatches():
            raise ConfigError(
                "dataloader.drop_last",
                False,
                f"the last training batch of an epoch holds {last} samples per data rank, which "
                f"parallel.pipeline.microbatches={self.microbatches()} does not divide into equal microbatches; set "
                "--dataloader.drop_last true (or a dataset size the batches divide)",
            )

    # ---- the step ------------------------------------------------------------------------------------------------

    def autocast(self) -> AbstractContextManager:
        """No autocast: FSDP2's mixed-precision policy casts the parameters (`fsdp_kwargs`)."""
        return NO_CONTEXT

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        """FSDP2 reduce-scatters the gradients of the last micro-batch of a window only (as DDP's `no_sync`)."""
        if last_micro_batch or self.pipeline is not None:
            return NO_CONTEXT
        return self._gradient_sync_off()

    @contextlib.contextmanager
    def _gradient_sync_off(self) -> Iterator[None]:
        modules = [part for part in self.model_parts if isinstance(part, FSDPModule)]
        for module in modules:
            module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True)

    def forward_backward(self, window: list[Any]) -> torch.Tensor:
        """Without a pipeline, BaseRunner's. With one, the schedule runs forward and backward of each batch of the
        window (cut into microbatches) over the stages; the loss is the criterion's on the last stage, shared with
        every stage of the pipeline."""
        with loss_context(self.loss_parallel()):
            if self.pipeline is None:
                return local_loss(super().forward_backward(window))
            return self.pipeline.train_window([self._pipeline_batch(batch) for batch in window])

    def loss_parallel(self) -> bool:
        """Whether the loss runs under torch's `loss_parallel()` (`parallel.loss_parallel` with tensor > 1)."""
        return self.config.parallel.loss_parallel and self.topology.tensor > 1

    def _pipeline_batch(self, batch: Any) -> tuple[Any, Any, int]:
        from perdure.data.batch import batch_length

        size = batch_length(batch)
        assert self.pipeline is not None  # a batch is split so for a pipeline only
        if not (self.pipeline.is_first or self.pipeline.is_last):
            return None, None, size
        inputs, target = self.unpack_batch(batch)
        return inputs, target, size

    def evaluate_step(self, batch: Any) -> Mapping[str, torch.Tensor | float]:
        if self.pipeline is None:
            metrics = super().evaluate_step(batch).items()
            return {key: local_loss(value) if isinstance(value, torch.Tensor) else value for key, value in metrics}
        inputs, target, size = self._pipeline_batch(batch)
        return {"loss": self.pipeline.evaluate_batch(inputs, target, size)}

    @contextlib.contextmanager
    def evaluation_context(self) -> Iterator[None]:
        """The default's, under loss parallelism when `loss_parallel()` says so (evaluation computes the loss too)."""
        with super().evaluation_context(), loss_context(self.loss_parallel()):
            yield

    def evaluates_in_lockstep(self) -> bool:
        """True: FSDP2 gathers the parameters of every forward collectively (tensor and pipeline parallelism run
        every forward together too)."""
        return True

    def infer(self, split: str) -> torch.Tensor:
        if self.pipeline is not None:
            raise PerdureError("infer() runs the model as one module; under pipeline parallelism export the weights "
                               "(model.pth) and load them with --pretrained on one process instead")  # fmt: skip
        return super().infer(split)

    def gradient_norm(self, parameters: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """The norm over the whole mesh (every shard, every stage: `distributed/grad_norm.py`); the finite check looks
        at this rank's shards (the optimizer step then agrees it over every rank)."""
        return clip_grad_norm(parameters, max_norm, self.pipeline.group if self.pipeline is not None else None)

    # ---- checkpoints and exports ---------------------------------------------------------------------------------

    def checkpoint_states(self) -> dict[str, Stateful]:
        """BaseRunner's objects, with the model and optimizer as this rank's shards under the whole model's names."""
        states = super().checkpoint_states()
        states["model"] = ShardedModel(self.model_parts)
        states["optimizer"] = ShardedOptimizer(self.model_parts, self.optimizer)
        return states

    def read_pretrained(self, path: Path) -> WeightSlices:
        """The `--pretrained` weights opened to be read slice by slice (`open_weight_slices`): their names, shapes and
        dtypes now (a safetensors header, a mapped torch.save file, a DCP `.metadata`); `distribute_model` checks
        them against the whole model and each rank reads the regions of its shards once it holds them
        (`pretrained_shards.py`)."""
        return open_weight_slices(path)

    def restore(self, source: RestoreSource) -> None:
        if source.kind == "pretrained":  # read into this rank's shards in `distribute_model`
            self.logger.info("%s", source.describe())
            return
        super().restore(source)

    def load_pretrained(self, path: Path, ema: bool = False) -> None:
        """Load model (or EMA) weights into the sharded model, shard by shard: each rank reads the regions it holds
        (`pretrained_shards.py`). Under a pipeline only this rank's stages are checked (keys of other stages are
        not refused as unexpected)."""
        slices = open_weight_slices(Path(path), ema=ema)
        plan = plan_pretrained(self.model_parts, slices, self.state_dict_adapter(), whole=self.topology.pipeline == 1)
        load_shards(self.model_parts, plan)

    def note_topology(self, info: CheckpointInfo) -> dict[str, Any] | None:
        """A resume on another topology (the override point's contract: checkpointing.py): the mesh axes too; the
        global batch follows the data ranks."""
        before = Topology.from_manifest(info.manifest.get("topology"))
        if before is None:
            world_size = info.manifest.get("world_size")
            before = Topology(shard=world_size) if type(world_size) is int and world_size > 0 else None
        if before is None or before == self.topology:
            return None
        per_rank = self.config.loader_options("train")["batch_size"] * self.config.accum_steps
        change = {
            "world_size": [before.world_size, self.world_size],
            "axes": [before.sizes(), self.topology.sizes()],
            "global_batch": [per_rank * before.data_size, per_rank * self.topology.data_size],
        }
        if not self.is_main_process:
            return change
        now, was = per_rank * self.topology.data_size, per_rank * before.data_size
        batch = f"stays {now}" if now == was else f"changes from {was} to {now}"
        self.logger.warning(
            "TOPOLOGY CHANGE: %s was written on %s, this attempt runs on %s: the global batch %s samples per "
            "optimizer step (%d data rank%s); the data position continues from the same sample; model, optimizer "
            "and EMA are resharded by DCP",
            info.name,
            before.describe(),
            self.topology.describe(),
            batch,
            self.topology.data_size,
            "" if self.topology.data_size == 1 else "s",
        )
        return change

    def export_model(self) -> Path | None:
        """Write the full weights of the whole model (each part's state dict through its hooks) on rank 0, streamed
        (`stream_exports`): one DTensor gathered at a time (a collective), written and dropped before the next, so
        rank 0 holds one whole tensor, never the whole model; the EMA's shadows the same way. With a pipeline, each
        tensor is gathered by its stage's ranks and sent to rank 0 by the stage's first rank (`_stage_source`). What
        state-dict hooks make (a fused weight split whole) is held one hooked module at a time (`module_source`)."""
        sources = {"model": module_source(self.model_parts, _whole)}
        if self.ema is not None:
            sources["model-ema"] = StreamSource.of_state(dict(self.ema.shadow), _whole)
        if self.topology.pipeline == 1:
            return self.stream_exports(sources)
        return self.stream_exports({name: self._stage_source(source) for name, source in sources.items()})

    def _stage_source(self, source: StreamSource) -> StreamSource:
        """With a pipeline: `source` (this rank's stage's) as a `StreamSource` over the whole model's tensors. The
        names, dtypes and shapes of every stage come from the rank at position 0 of its data and model axes (every
        rank learns them all: an all-gather of metadata); `whole(name)` is gathered by the ranks of the stage
        holding it (its mesh) and sent by that stage's first rank to rank 0 (point to point, one tensor at a time)."""
        sends = self.topology.stream_leader(self.rank) == self.rank and self.topology.data_rank(self.rank) == 0
        mine = source.shapes if sends else {}
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        owners: dict[str, int] = {}
        shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for rank, part in enumerate(everyone):
            for name, shape in part.items():
                owners[name], shapes[name] = rank, shape
        transport = self.device if dist.get_backend() == "nccl" else torch.device("cpu")

        def whole(name: str) -> torch.Tensor:
            value = source.whole(name) if name in source.shapes else None  # the stage's ranks gather it together
            owner = owners[name]
            if owner == 0 or self.rank not in (0, owner):
                return value if value is not None else torch.empty(0)
            if self.rank == owner:
                assert value is not None  # the owner's stage holds it
                dist.send(value.detach().contiguous().to(transport), dst=0)
                return value
            dtype, shape = shapes[name]
            received = torch.empty(shape, dtype=dtype, device=transport)
            dist.recv(received, src=owner)
            return received

        return StreamSource(shapes, whole)

    def write_hf_weights(self, staging: Path, ema: bool) -> None:
        """The `hf` export's weights (the override point's contract: checkpointing.py), shard by shard: every rank
        writes its shards of the state dict of DTensors (through the adapter's `to_hf`, tied keys left out) with
        DCP's Hugging Face writer, and rank 0 consolidates them (`write_with_dcp`); no rank gathers the model. A model
        whose state-dict hooks make tensors, without a pipeline, is streamed instead, as `model.safetensors` is
        (`module_source`: one DTensor gathered at a time, what hooks make one hooked module at a time): without an
        adapter, or with one that maps each key on its own (`hf_export.stream_adapted`: each tensor mapped alone
        through `to_hf`); with one that maps keys together it is written by DCP, what hooks make whole on every rank.
        A collective: every rank calls it."""
        adapter = self.state_dict_adapter()
        dtype = export_dtype(self)
        parts = self.model_parts
        if not ema and self.topology.pipeline == 1 and hooks_make_tensors(parts):
            tied = {key for part in parts for key in tied_keys(uncompiled(part))}
            source = module_source(parts, _whole)
            if adapter is None:
                stream_weights(self, source, tied, staging, dtype)
                return
            whole = "every rank holds what the state-dict hooks make for the whole model"
            if stream_adapted(self, source, tied, staging, dtype, adapter, whole):
                return
        state: dict[str, Any] = {}
        if ema:
            assert self.ema is not None  # `export_hf` makes an EMA job only for a runner with an EMA
            state.update(self.ema.shadow)
        else:
            for part in self.model_parts:
                state.update(module_state_dict(part))
        state = adapter.to_hf(state) if adapter is not None else untied(state, self)
        write_with_dcp(distinct(state, every_rank=True), staging, dtype)


def _whole(value: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into a full tensor (a collective over its mesh); any other tensor as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value
