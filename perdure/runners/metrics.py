"""Metrics reporting: the part of the runner that turns the loop's losses and throughput into log lines and metrics."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from perdure.data.loader import ResumableLoader
from perdure.loggers.base import MetricLogger
from perdure.loggers.factory import build_loggers
from perdure.runners.fields import RunnerFields
from perdure.runners.losses import mean_loss
from perdure.runners.peak_flops import device_peak_flops
from perdure.runners.throughput import model_device


class MetricsMixin(RunnerFields):
    """The throughput meter's start, the train log line, and the public `log_metrics` / `log_image`. Part of
    `BaseRunner` (one concept per file); it uses the runner's `state`, `config`, `optimizer`, `meter`, `telemetry` and
    the loop's pending `_losses`."""

    # The global gradient norm before clipping of the last optimizer step that took it (`grad_norm_due`): the
    # `grad_norm` column of the next train log line. A tensor until the line is written (no device sync per step).
    grad_norm: torch.Tensor | float | None = None

    def grad_norm_due(self) -> bool:
        """Called by a stack's optimizer step before it steps: whether to take the gradient norm (over every shard and
        stage) now. True when gradients are clipped (the norm is taken anyway) or the step ends at a train log line;
        the same on every rank, so a norm that needs collectives is taken by all of them. Must not change state."""
        return bool(self.config.max_grad_norm) or (self.state.global_step + 1) % self.cadence.log_every == 0

    def _start_meter(self, loader: ResumableLoader, counts_tokens: bool) -> None:
        """The loop starts: what the log lines' throughput columns need (token counting when the runner overrides
        `batch_tokens`, FLOPs, peak, budget)."""
        if self.config.training_mode() == "steps":
            total: int | None = self.config.steps
        else:
            total = self.total_steps_hint() if loader.samples_per_epoch() is not None else None
        device = model_device(self.unwrap_model())
        self.stragglers.start(self.state.global_step, device)
        self.meter.start(
            self.state.global_step,
            total_steps=total,
            device=device,
            count_tokens=self.batch_tokens if counts_tokens else None,
            flops_per_token=self.flops_per_token(),
            peak_flops=device_peak_flops(device, self.config.precision, self.config.perf.peak_flops),
            data_ranks=loader.world_size,  # tensor / pipeline / context peers read the same batches: counted once
        )

    def _log_train_progress(self) -> None:
        if not self._losses:
            return
        loss = mean_loss(self._losses)  # floats carried over a resume, then this run's tensors
        self._losses.clear()
        metrics = {"loss": loss, "lr": self.optimizer.param_groups[0]["lr"]}
        if self.grad_norm is not None:
            metrics["grad_norm"] = float(self.grad_norm)
            self.grad_norm = None
        metrics.update(self.meter.metrics(self.state.global_step))
        # rides on the stop check's collective (several ranks): every rank's step time, the slow ones named
        metrics.update(self.stragglers.exchange(self.preemption.received or 0, self.state.global_step))
        self.log_metrics("train", metrics)
        self.telemetry.flush()

    def log_metrics(self, split: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Report metrics of `split` at `step` (default: the current global step) to the console, the log file,
        metrics.csv, TensorBoard / W&B and the sidecar. Only the main process reports; others return."""
        self.telemetry.log_metrics(split, metrics, self.state.global_step if step is None else step)

    def metric_loggers(self) -> list[MetricLogger]:
        """Where this run's metrics and images go besides the console and the log file. Default: `metrics.csv`, the
        media writer, and TensorBoard / W&B when the config enables them. Override to add a destination (MLflow, Aim,
        a database): subclass `perdure.MetricLogger` and return `[*super().metric_loggers(), MyLogger()]`.

        Called once, on the main process only, inside `BaseRunner.__init__` once the run directory is decided: before
        the rest of your `__init__` runs, so it may read `self.config`, not attributes your `__init__` sets. It must
        not write anything: a logger creates its files in `open()`, after the restore.
        """
        return build_loggers(self.config)

    def log_image(self, tag: str, image: Any, step: int | None = None) -> None:
        """Save an image (HW, HWC or CHW; float in [0, 1] or uint8) under `media/<tag>/` and forward it to
        TensorBoard / W&B. Only the main process writes."""
        self.telemetry.log_image(tag, image, self.state.global_step if step is None else step)
