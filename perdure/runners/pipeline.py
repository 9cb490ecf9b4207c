"""Pipeline parallelism: splitting the model into stages, and running a window of batches through a schedule.

A model splits itself: `model.pipeline_stage(stage_index, num_stages)` returns the module of one stage, which must keep
the parameter names of the whole model (copy the model and delete what the stage does not hold, as TorchTitan does;
blocks in an `nn.ModuleDict` keep their names). The names are checked: a stage that renames, reshapes or invents a
parameter, or stages that together miss or repeat one, are refused. Same names on every topology are what lets a
checkpoint of 2 stages load on 1 (DCP matches tensors by name).

Each rank holds `virtual_stages` stages (Interleaved1F1B: stages r, r + P, r + 2P, ... of P ranks). The batch is cut
into `microbatches` equal parts; the criterion runs on the last stage, per microbatch, and its loss is scaled by
1 / (microbatches x batches in the window) before the backward, so the gradients are the mean over the window as
without a pipeline (the criterion must average over its microbatch, as it does over a batch without a pipeline).
The schedule drives the forward and the backward: `train_step` is never called. The window's loss (the mean of the
criterion's values) is sent from the last stage to every stage of its pipeline, for logging and agreement.

A schedule sizes its communication buffers at its first step, so there is one schedule per batch size (and per mode:
training or evaluation); every stage of a pipeline reads batches of the same size (one data rank), so they agree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from perdure.errors import ConfigError, PerdureError

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
KEY = "parallel.axes.pipeline"


def stage_indices(pipeline_rank: int, pipeline_size: int, virtual_stages: int) -> list[int]:
    """The stages rank `pipeline_rank` holds: r, r + P, r + 2P, ... ("loop" placement, what Interleaved1F1B runs)."""
    return [pipeline_rank + round_ * pipeline_size for round_ in range(virtual_stages)]


def split_model(model: nn.Module, indices: list[int], num_stages: int) -> list[nn.Module]:
    """This rank's stages from `model.pipeline_stage(index, num_stages)`, each checked against the whole model's
    parameter names and shapes."""
    if not callable(getattr(type(model), "pipeline_stage", None)):
        raise ConfigError(
            KEY,
            num_stages,
            f"{type(model).__name__} has no pipeline_stage(stage_index, num_stages) method, so it cannot be split "
            "into stages; give it one (returning the stage's module with the whole model's parameter names), or set "
            f"{KEY} to 1",
        )
    whole = {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
    stages = []
    for index in indices:
        stage = cast(Any, model).pipeline_stage(index, num_stages)  # the method of its class, found above
        check_stage(stage, index, num_stages, whole)
        stages.append(stage)
    return stages


def check_stage(stage: Any, index: int, num_stages: int, whole: Mapping[str, tuple[int, ...]]) -> None:
    """A stage is a module whose parameters are a subset of the whole model's, under the same names and shapes."""
    where = f"pipeline_stage({index}, {num_stages})"
    if not isinstance(stage, nn.Module):
        raise ConfigError(KEY, num_stages, f"{where} returned a {type(stage).__name__}, not an nn.Module")
    own = {name: tuple(parameter.shape) for name, parameter in stage.named_parameters()}
    renamed = sorted(set(own) - set(whole))
    if renamed:
        raise ConfigError(
            KEY,
            num_stages,
            f"{where} returned parameters the whole model has no parameter of that name for: {', '.join(renamed[:5])}"
            f"{', ...' if len(renamed) > 5 else ''}. A stage must keep the whole model's names (checkpoints match "
            "tensors by name): copy the model and delete what the stage does not hold instead of building new "
            "containers (e.g. keep the blocks in an nn.ModuleDict under their index)",
        )
    reshaped = [f"{name} {own[name]} (model: {whole[name]})" for name in own if own[name] != whole[name]]
    if reshaped:
        raise ConfigError(KEY, num_stages, f"{where} changed the shape of {', '.join(reshaped[:5])}")
    if not own:
        raise ConfigError(KEY, num_stages, f"{where} holds no parameters: use fewer stages than the model has blocks")


def check_cover(names_by_stage: Mapping[int, list[str]], whole: list[str]) -> None:
    """All stages together hold every parameter of the whole model exactly once."""
    held: dict[str, int] = {}
    for index in sorted(names_by_stage):
        for name in names_by_stage[index]:
            if name in held:
                raise ConfigError(
                    KEY,
                    len(names_by_stage),
                    f"stages {held[name]} and {index} both hold {name}: each parameter must live on one stage (tied "
                    "weights across stages are not supported)",
                )
            held[name] = index
    missing = [name for name in whole if name not in held]
    if missing:
        raise ConfigError(
            KEY,
            len(names_by_stage),
            f"no stage holds {', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}: pipeline_stage must "
            "split the whole model",
        )


def check_microbatches(schedule: str, microbatches: int, num_stages: int, batch_size: int) -> None:
    """Refuse what a schedule cannot run, before anything is written."""
    key = "parallel.pipeline.microbatches"
    if schedule in ("1F1B", "Interleaved1F1B") and microbatches < num_stages:
        raise ConfigError(key, microbatches, f"{schedule} needs at least one microbatch per stage ({num_stages})")
    if batch_size % microbatches:
        raise ConfigError(
            key,
            microbatches,
            f"the batch of dataloader.batch_size={batch_size} samples must split into equal microbatches; use a "
            "divisor of the batch size",
        )


class Pipeline:
    """This rank's stages of one pipeline and their schedules (one per batch size and mode)."""

    def __init__(
        self,
        parts: list[nn.Module],
        indices: list[int],
        num_stages: int,
        *,
        group: dist.ProcessGroup,
        last_rank: int,
        device: torch.device,
        schedule: str,
        microbatches: int,
        criterion: Callable[[Any, Any], torch.Tensor],
    ) -> None:
        self.parts, self.indices, self.num_stages = parts, indices, num_stages
        self.group, self.last_rank, self.device = group, last_rank, device
        self.schedule_name, self.microbatches, self.criterion = schedule, microbatches, criterion
        self.is_first = 0 in indices
        self.is_last = num_stages - 1 in indices
        self._schedules: dict[tuple[str, int], Any] = {}
        self._losses: list[torch.Tensor] = []
        self._denominator = 1

    def _schedule(self, mode: str, batch_size: int) -> Any:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        key = (mode, batch_size)
        if key not in self._schedules:
            # Each schedule takes a list of torch's private stage base class, which PipelineStage subclasses.
            stages: list[Any] = [
                PipelineStage(part, index, self.num_stages, self.device, group=self.group)
                for part, index in zip(self.parts, self.indices)
            ]
            if mode == "eval":
                # Forward only, the batch as one microbatch: the data ranks' last batches may differ in size, and
                # FSDP needs the same number of forwards on each
                count = 1
                schedule: Any
                if len(stages) > 1:
                    schedule = ScheduleLoopedBFS(stages, count, loss_fn=self._loss, scale_grads=False)
                else:
                    schedule = ScheduleGPipe(stages[0], count, loss_fn=self._loss, scale_grads=False)
            else:
                if batch_size % self.microbatches:
                    raise PerdureError(
                        f"a training batch of {batch_size} samples does not split into parallel.pipeline.microbatches="
                        f"{self.microbatches} equal parts (the last batch of an epoch?): set --dataloader.drop_last "
                        "true, or a batch size and dataset the microbatches divide"
                    )
                classes = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B}
                chosen = classes[self.schedule_name]
                try:
                    target = stages if self.schedule_name == "Interleaved1F1B" else stages[0]
                    schedule = chosen(target, self.microbatches, loss_fn=self._loss, scale_grads=False)
                except ValueError as error:
                    raise ConfigError("parallel.pipeline.microbatches", self.microbatches, str(error)) from None
            self._schedules[key] = schedule
        return self._schedules[key]

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self.criterion(output, target)
        self._losses.append(loss.detach())
        return loss / self._denominator

    def train_window(self, batches: list[tuple[Any, Any, int]]) -> torch.Tensor:
        """Forward and backward of a window of (inputs, target, size) batches (inputs only used on the first stage,
        target on the last); returns the window's mean loss on every stage of this pipeline."""
        self._denominator = self.microbatches * len(batches)
        losses = []
        for inputs, target, size in batches:
            schedule = self._schedule("train", size)
            schedule.step(*self._args(inputs), target=target if self.is_last else None)
            losses += self._take_losses(self.microbatches)
        return self._shared_loss(losses)

    @torch.no_grad()
    def evaluate_batch(self, inputs: Any, target: Any, size: int) -> torch.Tensor:
        """The criterion's mean over one evaluation batch, on every stage of this pipeline."""
        self._denominator = 1
        schedule = self._schedule("eval", size)
        schedule.eval(*self._args(inputs), target=target if self.is_last else None)
        return self._shared_loss(self._take_losses(1))

    def _take_losses(self, count: int) -> list[torch.Tensor]:
        """The criterion's values of the step just run: its last `count` calls (a schedule's first step also calls it
        once on placeholder tensors, to learn the shapes of the gradients it will exchange)."""
        losses, self._losses = self._losses[-count:], []
        return losses

    def _args(self, inputs: Any) -> tuple[Any, ...]:
        if not self.is_first:
            return ()
        return tuple(inputs) if isinstance(inputs, tuple) else (inputs,)

    def _shared_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's losses, sent to every stage of the pipeline."""
        loss = torch.stack(losses).float().mean() if self.is_last else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss


class PositionOnly(torch.utils.data.Dataset):
    """A map-style dataset's length without its samples: what a middle pipeline stage reads (it needs the data
    position and the batch size, never the data). Every item is 0."""

    def __init__(self, dataset: Any) -> None:
        self.length = len(dataset)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return 0


class ModelParts(nn.ModuleList):
    """The stages one pipeline rank holds (Interleaved1F1B), as one module for what treats the model as a whole:
    `train()` / `eval()`, `parameters()`, and `state_dict()`, which merges the stages' under the whole model's names
    (what the EMA averages). It has no forward: the schedule runs the stages."""

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        merged: dict[str, Any] = {}
        for part in self:
            merged.update(part.state_dict(*args, **kwargs))
        return merged

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PerdureError("the model is split into pipeline stages: the schedule runs them, not a call of the model")
