"""TorchRunner: plain PyTorch on one device, or DistributedDataParallel under torchrun (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from perdure.checkpoints.base import Stateful
from perdure.distributed.collectives import max_each_over_ranks
from perdure.distributed.ddp import FixedLayoutDDP
from perdure.distributed.process_group import init_process_group, local_device
from perdure.errors import ConfigError
from perdure.private_api import dtensor_local, non_finite_check_and_unscale_
from perdure.runners.accumulation import check_loss_normalization
from perdure.runners.base import BaseRunner
from perdure.runners.compile import compile_model, uncompiled
from perdure.runners.ema import ExponentialMovingAverage
from perdure.runners.meta_init import check_initialisable, initialise, is_meta_model, materialise

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
NO_CONTEXT = nullcontext()  # reusable: entering it does nothing


def _has_ft_layer(runner: Any) -> bool:
    from perdure.ft.runner import FaultTolerant

    return isinstance(runner, FaultTolerant)


class TorchRunner(BaseRunner):
    """CUDA when present, else CPU; autocast for bf16 / fp16, a GradScaler for fp16; clipping and the finite check.

    Launched with torchrun (WORLD_SIZE > 1) it joins the process group and wraps the model in DDP; the same program
    runs unchanged on one process.
    """

    def __init__(self, config: Any) -> None:
        if config.lookup("ft.enabled", False) and not _has_ft_layer(self):
            raise ConfigError(
                "ft.enabled",
                True,
                f"{type(self).__name__} subclasses TorchRunner directly, which trains no replica group: subclass "
                "perdure.Runner (it adds the TorchFT layer when ft.enabled), or list perdure.FaultTolerant before "
                "TorchRunner among your class's bases, or set --ft.enabled false",
            )
        check_loss_normalization(type(self), config)
        super().__init__(config)
        self.device = self.select_device()
        if self.device.type == "cuda":
            # The device's own CUDA context, and the generator `RNGState` saves as this process's (DDP on gloo
            # leaves the current device at 0 otherwise).
            torch.cuda.set_device(self.device)
        precision = config.precision
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        self._found_inf: torch.Tensor | None = None  # buffers of the non-finite check, made at the first step
        self._unit_scale: torch.Tensor | None = None
        # the gradients' layout, looked at the first step (per-parameter Python stays off the hot path, issue 37)
        self._sharded_grads: bool | None = None
        self._grads_on_one_device: bool | None = None

    def init_distributed(self) -> tuple[int, int]:
        return init_process_group(self.config.dist.backend, self.config.dist.timeout)

    def select_device(self) -> torch.device:
        """Called in `__init__`: the device this process trains on (its LOCAL_RANK's GPU, else the CPU)."""
        return local_device()

    def wrap_model(self) -> None:
        """`compile.enabled`: compile the model in place (`perdure.runners.compile`; its state dict keeps its plain
        names). Then, with several ranks, DDP with the gradient bucket layout fixed before the first step
        (`FixedLayoutDDP`): a resumed process reduces every step in the layout the uninterrupted run used, so a
        resume on the same world size is bit-exact on any number of ranks."""
        self.model = compile_model(self.model, self.config)
        if self.world_size > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = FixedLayoutDDP(self.model, device_ids=device_ids)

    def unwrap_model(self) -> torch.nn.Module:
        return uncompiled(self.model.module if isinstance(self.model, DistributedDataParallel) else self.model)

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        if isinstance(self.model, DistributedDataParallel) and not last_micro_batch:
            return self.model.no_sync()
        return NO_CONTEXT

    def place_model(self) -> None:
        """Move the model to the device; a model built on the meta device is allocated there and initialised
        instead (`materialise_model`)."""
        meta = is_meta_model(self.model)
        if meta:
            check_initialisable(self.model)
            self.materialise_model([self.model])
        else:
            self.model.to(self.device)
        if self.ema is not None and meta:  # an EMA the user built in __init__ of the model on meta: of its values now
            self.ema = ExponentialMovingAverage(self.unwrap_model(), self.ema.decay)
        elif self.ema is not None:  # an EMA the user built in __init__, before the model moved
            self.ema.to(self.device)
        if self.criterion is not None and isinstance(self.criterion, torch.nn.Module):
            self.criterion.to(self.device)

    def materialise_model(self, parts: list[torch.nn.Module]) -> None:
        """Called for a model built on the meta device once its parameters are where they will live (the torch
        stack: in `place_model`; the parallel stack: after sharding, with this rank's stages): allocate them on
        `self.device` and initialise them with the model's `init_weights()` or each submodule's
        `reset_parameters()`, every draw seeded by `seed` and the tensor's name, so every topology starts from the
        same weights (`perdure.runners.meta_init`). Must keep the parameter objects and must not communicate."""
        materialise(parts, self.device)
        initialise(parts, self.config.seed, self.device)

    def init_module(self) -> AbstractContextManager:
        """The context to build the model in, in `__init__` (`with self.init_module(): self.model = Net()`): on the
        torch stack the training device, so a GPU model is built there directly. Stacks that shard the model build
        it without holding it whole (the parallel stack: on the meta device; DeepSpeed ZeRO-3: partitioned)."""
        return self.device

    def autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return NO_CONTEXT
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def optimizer_step(self) -> bool:
        optimizer = self.optimizer
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        finite = self.clip_and_check_gradients(parameters)
        if self.world_size > 1 and not isinstance(self.model, DistributedDataParallel):
            # DDP all-reduced the gradients, so every rank holds the same ones and decides alike without a collective
            # (an inf or NaN on one rank is in every rank's average); other wrappers' ranks hold their own part.
            finite = self.agree_finite(finite)
        if self.scaler is not None:
            if finite:
                self.scaler.step(optimizer)
            self.scaler.update()
        elif finite or not self.config.skip_nonfinite_grad:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return finite or not self.config.skip_nonfinite_grad

    def agree_finite(self, finite: bool) -> bool:
        """Whether every rank's gradients are finite (`finite`: this rank's), agreed in one all-reduce that also
        carries the preemption signal each rank holds, so the stop check after this step needs no collective of its
        own. Called by `optimizer_step` on every rank at the same point when the ranks' gradients differ."""
        not_finite, signal = max_each_over_ranks([0 if finite else 1, self.preemption.received or 0])
        self.stragglers.agreed_at_this_step(signal)
        return not not_finite

    def clip_and_check_gradients(self, parameters: list[torch.Tensor]) -> bool:
        """Called by `optimizer_step` after unscaling: take the gradient norm when it is due (`grad_norm_due`: kept
        in `self.grad_norm` for the log line) and clip to `max_grad_norm` when set; return whether every gradient is
        finite (checked only when clipping or `skip_nonfinite_grad` asks for it). The caller agrees the answer over
        all ranks. Must not step or zero anything.

        A norm taken anyway answers the check when it is finite (an inf or a NaN in any gradient makes the 2-norm inf
        or NaN), so a log line's step reads the gradients once; a norm that is not finite may be the overflow of a
        sum of finite squares, so the gradients are then checked one by one as on any other step."""
        max_norm = self.config.max_grad_norm or None
        if max_norm or self.grad_norm_due():
            self.grad_norm = self.gradient_norm(parameters, max_norm)
            if max_norm:
                return bool(torch.isfinite(self.grad_norm))
            if self.config.skip_nonfinite_grad and bool(torch.isfinite(self.grad_norm)):
                return True
        if self.config.skip_nonfinite_grad:
            grads = [p.grad for p in parameters if p.grad is not None]
            if self._sharded_grads is None:  # the model's layout is fixed once training runs: looked at once
                self._sharded_grads = any(isinstance(grad, DTensor) for grad in grads)
            if self._sharded_grads:
                grads = [dtensor_local(grad) if isinstance(grad, DTensor) else grad for grad in grads]
            return self._grads_finite(grads)
        return True

    def gradient_norm(self, parameters: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """The 2-norm of the model's gradients before clipping, the same on every rank; with `max_norm`, the gradients
        are then clipped to it (one pass). Called by `clip_and_check_gradients`; a stack whose gradients are sharded
        or split into stages overrides it. Must not step or zero anything."""
        if max_norm:
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])

    def _grads_finite(self, grads: list[torch.Tensor]) -> bool:
        """One fused pass over the gradients per device (the kernel GradScaler uses, with a scale of exactly 1)."""
        if not grads:
            return True
        if self._found_inf is None:
            self._found_inf = torch.zeros(1, device=grads[0].device)
            self._unit_scale = torch.ones(1, device=grads[0].device)
        found, unit = self._found_inf, self._unit_scale
        assert unit is not None  # made with `_found_inf`
        device = found.device
        if self._grads_on_one_device is None:  # looked at once, as above
            self._grads_on_one_device = all(grad.device == device for grad in grads)
        if self._grads_on_one_device:
            non_finite_check_and_unscale_(grads, found, unit)
        else:  # gradients on several devices (a model split by hand): one pass per device
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for grad in grads:
                by_device.setdefault(grad.device, []).append(grad)
            for other, group in by_device.items():
                flag = torch.zeros(1, device=other)
                non_finite_check_and_unscale_(group, flag, unit.to(other))
                found.add_(flag.to(device))
        if found.item():
            found.zero_()
            return False
        return True

    def extra_states(self) -> dict[str, Stateful]:
        return {"scaler": self.scaler} if self.scaler is not None else {}

    def to_device(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return data if data.device == self.device else data.to(self.device, non_blocking=True)
        if isinstance(data, Mapping):
            return {key: self.to_device(value) for key, value in data.items()}
        if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple takes its fields as arguments
            return type(data)(*(self.to_device(value) for value in data))
        if isinstance(data, (list, tuple)):
            return type(data)(self.to_device(value) for value in data)
        return data
