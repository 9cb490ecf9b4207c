"""TorchRunner: plain PyTorch on one device, or DistributedDataParallel under torchrun (NCCL on CUDA, gloo on CPU)."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from perdure.checkpoints.base import Stateful
from perdure.distributed.collectives import all_ranks
from perdure.distributed.process_group import init_process_group, local_device
from perdure.runners.base import BaseRunner

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TorchRunner(BaseRunner):
    """CUDA when present, else CPU; autocast for bf16 / fp16, a GradScaler for fp16; clipping and the finite check.

    Launched with torchrun (WORLD_SIZE > 1) it joins the process group and wraps the model in DDP; the same program
    runs unchanged on one process.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.device = self.select_device()
        precision = config.precision
        self.autocast_dtype = AUTOCAST_DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None

    def init_distributed(self) -> tuple[int, int]:
        return init_process_group(self.config.dist.backend, self.config.dist.timeout)

    def select_device(self) -> torch.device:
        """Called in `__init__`: the device this process trains on (its LOCAL_RANK's GPU, else the CPU)."""
        return local_device()

    def wrap_model(self) -> None:
        if self.world_size > 1:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(self.model, device_ids=device_ids)

    def unwrap_model(self) -> torch.nn.Module:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    def no_sync(self, last_micro_batch: bool) -> AbstractContextManager:
        if isinstance(self.model, DistributedDataParallel) and not last_micro_batch:
            return self.model.no_sync()
        return nullcontext()

    def place_model(self) -> None:
        self.model.to(self.device)
        if self.criterion is not None and isinstance(self.criterion, torch.nn.Module):
            self.criterion.to(self.device)

    def autocast(self) -> AbstractContextManager:
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def optimizer_step(self) -> bool:
        optimizer = self.optimizer
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        finite = True
        if self.config.max_grad_norm:
            norm = torch.nn.utils.clip_grad_norm_(
                [p for group in optimizer.param_groups for p in group["params"]], self.config.max_grad_norm
            )
            finite = bool(torch.isfinite(norm))
        elif self.config.skip_nonfinite_grad and grads:
            finite = bool(torch.isfinite(torch.nn.utils.get_total_norm(grads, foreach=True)))
        if self.world_size > 1:
            finite = all_ranks(finite)  # all-reduced gradients agree already; this makes the skip a joint decision
        if self.scaler is not None:
            if finite:
                self.scaler.step(optimizer)
            self.scaler.update()
        elif finite or not self.config.skip_nonfinite_grad:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return finite or not self.config.skip_nonfinite_grad

    def extra_states(self) -> dict[str, Stateful]:
        return {"scaler": self.scaler} if self.scaler is not None else {}

    def to_device(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor):
            return data.to(self.device, non_blocking=True)
        if isinstance(data, Mapping):
            return {key: self.to_device(value) for key, value in data.items()}
        if isinstance(data, (list, tuple)):
            return type(data)(self.to_device(value) for value in data)
        return data
