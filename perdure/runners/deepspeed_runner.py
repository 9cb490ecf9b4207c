"""DeepSpeedRunner: ZeRO 0-3 through the DeepSpeed engine, driven by the one loop of `base.py`.

The runner builds the engine from its config (`deepspeed_config.engine_config`: the runner's keys over the user's raw
DeepSpeed settings) with the user's model and torch optimizer; the scheduler stays the runner's and is stepped by the
loop as on every stack. The loop's override points map onto the engine:

    no_sync(last_micro_batch)  engine.set_gradient_accumulation_boundary(last): DeepSpeed reduces and steps only at
                               the window's last micro-batch, however long the window is (an epoch's last may be short)
    backward(loss)             engine.backward(loss, scale_wrt_gas=False): the loop already divided by the window
    optimizer_step()           engine.step(): clipping, the non-finite / fp16-overflow skip (agreed by every rank in
                               DeepSpeed's own all-reduce), the step, zeroed gradients; `was_step_applied()` is the
                               answer the loop counts skipped steps with; `grad_norm` is the engine's global norm
                               (ZeRO 1-3), the runner's over the whole gradients under ZeRO-0
    checkpoint_states()        the engine replaces model and optimizer: the deepspeed backend saves it with
                               `engine.save_checkpoint` into perdure's staging dir (`checkpoints/deepspeed_engine.py`)

The engine is built when the restore begins, because a DeepSpeed checkpoint can only be loaded into an engine; a
`--pretrained` load goes into the plain module first, which the engine then partitions. Under ZeRO-3 the weights are
opened from their metadata and read one tensor at a time: into a model built partitioned (`init_module`), each rank
reads only its partition's part of each parameter (`zero3_pretrained.py`), so no rank holds the whole model.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from perdure.checkpoints.base import Stateful
from perdure.checkpoints.deepspeed_engine import (
    DeepSpeedCheckpointManager,
    EngineState,
    StreamedState,
    read_deepspeed_weights,
    read_streamed,
)
from perdure.checkpoints.module_state import as_module_state_dict
from perdure.checkpoints.read import open_weight_slices
from perdure.checkpoints.source import RestoreSource
from perdure.checkpoints.weights_slices import WeightSlices
from perdure.distributed.deepspeed_env import check_precision, import_deepspeed
from perdure.distributed.process_group import launched_world_size, select_backend
from perdure.errors import CheckpointError
from perdure.runners.compile import strip_compile_prefix, uncompiled
from perdure.runners.deepspeed_config import engine_config
from perdure.runners.ema import ExponentialMovingAverage, average_into
from perdure.runners.export import StreamSource, export_streamed
from perdure.runners.hf_export import (
    export_dtype,
    stream_adapted,
    stream_weights,
    tied_keys,
    write_whole_weights,
)
from perdure.runners.pretrained_shards import describe_reads, load_shards, plan_pretrained
from perdure.runners.torch_runner import NO_CONTEXT, TorchRunner
from perdure.runners.zero3_export import zero3_source
from perdure.runners.zero3_pretrained import gathered_whole, is_partitioned, load_partitions, whole_shape

if TYPE_CHECKING:
    from perdure.runners.zero3_pretrained import ZeroParameter


class DeepSpeedRunner(TorchRunner):
    """`stack=deepspeed` (alias `ds`). See the module docstring; the user's side is the same as on the torch stack."""

    checkpoint_manager_class = DeepSpeedCheckpointManager

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.engine: Any = None
        self.scaler = None  # DeepSpeed's fp16 optimizers scale the loss themselves (dynamic loss scaling)

    def init_distributed(self) -> tuple[int, int]:
        """Torch's process group (gloo on CPU, NCCL on CUDA), which DeepSpeed then uses; a lone process gets a group
        of one, since the engine needs one."""
        import_deepspeed()
        check_precision(self.config.precision)
        if launched_world_size() == 1 and not dist.is_initialized():
            os.environ.setdefault("LOCAL_RANK", "0")  # the engine asks for it; nothing else reads it here
            backend = select_backend(self.config.dist.backend)
            timeout = timedelta(seconds=self.config.dist.timeout)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return super().init_distributed()

    # ---- building the engine --------------------------------------------------------------------------------------

    def init_module(self) -> AbstractContextManager:
        """Under ZeRO-3, `deepspeed.zero.Init` with the engine's config: each module's parameters are partitioned
        over the ranks as soon as the module is built, so no rank holds the whole model (each module is initialised
        whole, one at a time, under the run's seed, so the model starts as one built eagerly). Under ZeRO 0-2 every
        stack's (the device: those stages keep whole parameters on every rank)."""
        if self.config.deepspeed.zero_stage != 3:
            return super().init_module()
        deepspeed = import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        # DeepSpeed's view of the process group (what `deepspeed.initialize` sets up later) sizes the partitions
        deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        return deepspeed.zero.Init(config_dict_or_path=engine_config(self.config, self.world_size))

    def place_model(self) -> None:
        """Every stack's, except for a model built partitioned (`init_module` under ZeRO-3): its partitions are
        where DeepSpeed put them."""
        from deepspeed.runtime.zero.partition_parameters import is_zero_param

        if not any(is_zero_param(parameter) for parameter in self.model.parameters()):
            return super().place_model()
        if isinstance(self.criterion, torch.nn.Module):
            self.criterion.to(self.device)

    def read_pretrained(self, path: Path) -> Any:
        """Under ZeRO-3 the `--pretrained` weights opened to be read one tensor at a time (`open_weight_slices`: their
        names, shapes and dtypes now); `restore` checks them against the whole model and each rank reads the parts
        of its partitions. Under ZeRO 0-2 every stack's (the full state dict: those stages hold whole parameters)."""
        if self.config.deepspeed.zero_stage != 3:
            return super().read_pretrained(path)
        return open_weight_slices(path)

    def restore(self, source: RestoreSource) -> None:
        """Called in `__post_init__`, after the loaders are built: builds the engine, then restores as every stack does
        (a checkpoint through the engine; `--pretrained` weights into the module before the engine is built, since
        the engine takes its flat partitions and master weights from it)."""
        if source.kind == "pretrained":
            if self.config.deepspeed.zero_stage == 3:
                self.logger.info("%s", source.describe())
                assert source.path is not None  # a pretrained source carries its weights' path
                self._load_pretrained_slices(self.checkpointing.take_pretrained(), source.path)
            else:
                super().restore(source)  # into the whole module
            self._build_engine()
        else:
            self._build_engine()
            super().restore(source)

    def _load_pretrained_slices(self, slices: WeightSlices, path: Path) -> None:
        """ZeRO-3, before the engine is built: names and shapes checked against the whole model (a partitioned
        parameter's `ds_shape`), then a model built partitioned gets each rank's part of each parameter
        (`load_partitions`), one built whole every tensor, one at a time (`load_shards`). A hooked module's hooks run
        on its parameters gathered whole, one hooked module at a time (`gathered_whole`), never on empty partitions."""
        partitioned = any(is_partitioned(parameter) for parameter in self.model.parameters())
        gathered = gathered_whole if partitioned else None
        adapter = self.state_dict_adapter()
        plan = plan_pretrained(self.model, slices, adapter, full_shape=whole_shape, gathered=gathered)
        if partitioned:
            load_partitions(self.model, plan)
            self.logger.info("%s", describe_reads(plan, path))
        else:
            load_shards([self.model], plan)

    def _build_engine(self) -> None:
        deepspeed = import_deepspeed()
        settings = engine_config(self.config, self.world_size)
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, optimizer=self.optimizer, config=settings)
        self.model = self.engine
        stage = self.engine.zero_optimization_stage()
        if stage in (1, 2) and self.config.precision == "fp32":
            # ZeRO 1/2 check fp32 gradients for inf / NaN only when told to (bf16 has a config key, fp16 always does).
            # With the global norm taken (DeepSpeed's default) a non-finite norm skips the step already, so the
            # separate check, a Python loop over every gradient and one more all-reduce, would only repeat it.
            self.engine.optimizer.check_grad_overflow = bool(self.config.skip_nonfinite_grad) and not (
                self.engine.zero_compute_grad_norm()
            )
        if stage == 3 and self.ema is not None:
            self.ema = _PartitionedEMA(self.ema, self.engine.module)

    def wrap_model(self) -> None:
        """Nothing to wrap: the engine was built when the restore began."""

    def unwrap_model(self) -> torch.nn.Module:
        return self.engine.module if self.engine is not None else self.model

    # ---- the loop's override points -----------------------------------------------------------------------------

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        self.engine.set_gradient_accumulation_boundary(last_micro_batch)
        return NO_CONTEXT

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> bool:
        engine = self.engine
        stage = engine.zero_optimization_stage()
        if stage == 0 and self.grad_norm_due():  # ZeRO-0: whole, reduced gradients; the engine keeps no norm
            self.grad_norm = self.gradient_norm(list(engine.module.parameters()), None)
        if self._checks_finite_itself():
            grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
            finite = self._grads_finite(grads)
            if self.world_size > 1:
                finite = self.agree_finite(finite)
            if not finite:
                engine.zero_grad()
                return False
        engine.step()
        if stage > 0 and self.grad_norm_due():  # ZeRO 1-3 take the global norm before clipping in every step
            self.grad_norm = engine.get_global_grad_norm()
        return bool(engine.was_step_applied())

    def _checks_finite_itself(self) -> bool:
        """ZeRO-0 without fp16 steps whatever the gradients hold: the runner checks them (as the torch stack does)."""
        return (
            self.engine.zero_optimization_stage() == 0
            and self.config.precision != "fp16"
            and (self.config.skip_nonfinite_grad)
        )

    def evaluates_in_lockstep(self) -> bool:
        """ZeRO-3 gathers each module's parameter partitions at its forward, a collective (ZeRO 0-2 keep whole
        parameters on every rank)."""
        return self.engine.zero_optimization_stage() == 3

    def checkpoint_states(self) -> dict[str, Stateful]:
        """The engine in place of model and optimizer (it saves both, partitioned); the rest as on every stack."""
        states: dict[str, Stateful] = {}
        for key, state in super().checkpoint_states().items():
            if key == "model":
                states["engine"] = EngineState(self.engine)
            elif key != "optimizer":
                states[key] = state
        return states

    def export_model(self) -> Path | None:
        """`model.pth` (and the other `ckpt.export_format`s): the fp32 weights of the checkpoint just committed under
        the names the module's `state_dict()` gives them (its hooks applied), written by the main process; EMA as on
        the torch stack. Under ZeRO-3 a collective that streams (`zero3_export.py`): each parameter's master copy (and
        each EMA shadow) is gathered and written into every format before the next, so rank 0 holds one whole
        parameter at a time, and what state-dict hooks make one hooked module at a time. Under ZeRO 1-2 DeepSpeed's
        zero-to-fp32 routine reads the checkpoint just committed (its files through the allow-list)."""
        stage = self.engine.zero_optimization_stage()
        if stage == 3:
            sources = {"model": zero3_source(self.engine.module)}
            if self.ema is not None:
                assert isinstance(self.ema, _PartitionedEMA)  # `_build_engine` makes it so under ZeRO-3
                sources["model-ema"] = self.ema.stream_source()
            return self.stream_exports(sources)
        written = None
        if self.is_main_process:
            weights = read_deepspeed_weights(self.run_dir.checkpoints / self.checkpointing.position_name())
            if stage > 0:  # keyed by parameter name: into the module's state-dict layout
                weights = as_module_state_dict(self.engine.module, weights)
            written = self.write_exports(weights, None)
            del weights  # written before the EMA is gathered: one whole copy at a time
        if self.ema is not None:
            ema = self.ema.weights()
            if self.is_main_process:
                self.write_exports(None, ema)
        return written

    def write_hf_weights(self, staging: Path, ema: bool) -> None:
        """The `hf` export's weights (the override point's contract: checkpointing.py), tensor by tensor
        (`zero3_source`, as `model.pth`): every rank gathers one fp32 parameter, or one hooked module's state dict,
        and rank 0 appends each tensor to its shard file (`stream_weights`). A ZeRO-3 EMA streams its shadows the same
        way (`stream_source`: one gathered at a time); a ZeRO 1-2 EMA is whole on every rank already. With an adapter
        that maps each key on its own (`hf_export.stream_adapted`), the same, each tensor mapped alone through `to_hf`;
        with one that maps keys together, `to_hf` needs the whole state dict: gathered on rank 0 only, one tensor at a
        time. Never through `save_pretrained`: a ZeRO-3 module holds only its partition. A collective: every rank
        calls it."""
        adapter = self.state_dict_adapter()
        tied = set(tied_keys(uncompiled(self.unwrap_model())))
        if not ema:
            source = zero3_source(self.unwrap_model())  # the engine's module
        elif isinstance(self.ema, _PartitionedEMA):
            source = self.ema.stream_source()
        else:
            assert self.ema is not None  # `export_hf` makes an EMA job only for a runner with an EMA
            if self.is_main_process:
                write_whole_weights(self, staging, self.ema.weights(), adapter, save_pretrained=False)
            return
        if adapter is None:
            stream_weights(self, source, tied, staging, export_dtype(self))
            return
        if stream_adapted(self, source, tied, staging, export_dtype(self), adapter, "rank 0 holds the whole model"):
            return
        weights = {}  # to_hf maps the whole state dict: gathered on the main process, one tensor at a time
        for name in source.shapes:
            if name not in tied:
                tensor = source.whole(name)  # a collective: every rank takes every name
                if self.is_main_process:
                    weights[name] = tensor.cpu()
        if self.is_main_process:
            write_whole_weights(self, staging, weights, adapter, save_pretrained=False)


class _PartitionedEMA(ExponentialMovingAverage, StreamedState):
    """The EMA under ZeRO-3: each rank averages only its own partition of every parameter (DeepSpeed's flat, padded
    `ds_tensor`), so no rank holds whole shadows while it trains; buffers, whole on every rank, are averaged whole.
    The average is taken element by element as the whole shadows' was, so the values are the same bit for bit.

    Whole shadows are made one parameter at a time (`whole`: a collective, every rank calls it together): a checkpoint
    holds them in `ema.pth`, written by rank 0 as each is gathered (`StreamedState`; mapped when read back, each rank
    copying its partition; any number of ranks and `read_deepspeed_weights` read it), and so do the exports
    (`stream_source`). `state_dict()` and `weights()` give them all at once (a checkpoint written before
    holds them so in its client_state, and loads as before)."""

    def __init__(self, ema: ExponentialMovingAverage, model: torch.nn.Module) -> None:
        """`ema`'s decay; the shadows taken from `model`'s partitions (a model built partitioned (`init_module`)
        gave `ema` its empty placeholders)."""
        self.decay = ema.decay
        sources = _sources(model)
        # the partitioned parameters by shadow name: what `weights` gathers and `load_state_dict` cuts
        self._partitioned = {name: tensor for name, tensor in sources.items() if is_partitioned(tensor)}
        self.shadow = {
            name: (_partition(tensor) if name in self._partitioned else tensor).detach().clone()
            for name, tensor in sources.items()
        }

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        average_into(
            (
                (self.shadow[name], (_partition(tensor) if name in self._partitioned else tensor).detach())
                for name, tensor in _sources(model).items()
            ),
            self.decay,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "shadow": self.weights()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, tensor in state["shadow"].items():
            parameter = self._partitioned.get(name)
            if parameter is None:
                self.shadow[name].copy_(tensor)
                continue
            partition, flat = self.shadow[name], tensor.reshape(-1)
            start = dist.get_rank(parameter.ds_process_group) * partition.numel()
            piece = flat[start : start + partition.numel()]
            partition[: piece.numel()].copy_(piece)

    def weights(self) -> dict[str, torch.Tensor]:
        """Whole shadows, each gathered alone from every rank's partition (collective)."""
        return {name: self.whole(name) for name in self.shadow}

    def whole(self, name: str) -> torch.Tensor:
        """The whole shadow `name`, gathered from every rank's partition (collective), or the buffer's own."""
        shadow, parameter = self.shadow[name], self._partitioned.get(name)
        if parameter is None:
            return shadow
        group = parameter.ds_process_group
        pieces = [torch.empty_like(shadow) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, shadow, group=group)
        return torch.cat(pieces)[: parameter.ds_numel].view(parameter.ds_shape)

    def stream_source(self) -> StreamSource:
        """The whole shadows to stream into a file, one at a time (their shapes from the parameters' `ds_shape`)."""
        shapes = {}
        for name, shadow in self.shadow.items():
            parameter = self._partitioned.get(name)
            shapes[name] = (shadow.dtype, tuple(shadow.shape if parameter is None else parameter.ds_shape))
        return StreamSource(shapes, self.whole)

    def write_tensors(self, path: Path | None) -> None:
        export_streamed(self.stream_source(), ["pth"], None if path is None else {"pth": path}, None, {})

    def small_state(self) -> dict[str, Any]:
        return {"decay": self.decay}

    def load_tensors(self, small: dict[str, Any], path: Path) -> None:
        """The whole shadows mapped from `path`, not read: each rank copies its partition of each (the pages it
        touches), one shadow at a time."""
        shadows = read_streamed(path, mmap=True)
        if set(shadows) != set(self.shadow):
            missing, unexpected = sorted(set(self.shadow) - set(shadows)), sorted(set(shadows) - set(self.shadow))
            raise CheckpointError(
                f"{path} does not hold this EMA's shadows: missing {missing}, unexpected {unexpected}"
            )
        for name in self.shadow:
            self.load_state_dict({"shadow": {name: shadows[name]}})


def _partition(parameter: torch.Tensor) -> torch.Tensor:
    """This rank's partition (`ds_tensor`) of a parameter `is_partitioned` found partitioned."""
    return cast("ZeroParameter", parameter).ds_tensor


def _sources(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state-dict entries by plain name, parameters as themselves (their partitions are read)."""
    return strip_compile_prefix(uncompiled(model).state_dict(keep_vars=True))
