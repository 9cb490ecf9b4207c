"""ThroughputMeter: the speed, memory and ETA columns of the train log lines.

Per optimizer step the loop only adds the step's sample count (and token count, when the runner counts tokens) to two
integers: no clock, no device sync. Everything else is measured when a log line is written:

    steps_per_s      optimizer steps per wall-clock second since the last line, everything included
    step_time        seconds per optimizer step since the last line, evaluation and checkpoint time excluded
    samples_per_s    samples of all data-parallel ranks per second of `step_time`
    tokens_per_s     tokens of all data-parallel ranks per second (when the runner's `batch_tokens` counts them)
    mfu              model FLOPs utilisation: tokens_per_s x flops_per_token / (peak FLOP/s x ranks), when the runner
                     knows its FLOPs per token and the device's peak is known (`perdure.runners.peak_flops`); every
                     rank's peak counts (tensor and pipeline peers share the work of the same tokens)
    peak_memory_mib  the process's peak memory so far: the CUDA allocator's peak on a GPU, the peak RSS on a CPU
    eta_s            seconds left at this attempt's average pace so far (evaluations and saves included)

Counts of all ranks are this rank's times the number of data-parallel ranks (every data rank reads batches of the same
size; tensor, pipeline and context peers of a data rank read the same batches, so they count once).
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch

TokenCounter = Callable[[Any], int]


class ThroughputMeter:
    """Made with the runner; `start` when the loop starts, `add` per optimizer step, `exclude` for the time an
    evaluation or a save took, `metrics` at each train log line."""

    def __init__(self, world_size: int = 1) -> None:
        self.world_size = world_size  # every rank's device: the peak MFU divides by
        self.data_ranks = world_size  # the ranks that read different batches: what tokens are counted over
        self.count_tokens: TokenCounter | None = None
        self.flops_per_token: float | None = None
        self.peak_flops: float | None = None
        self.device: torch.device | None = None
        self.total_steps: int | None = None
        self._start_time = self._last_time = time.perf_counter()
        self._start_step = self._last_step = 0
        self._samples = 0
        self._tokens = 0
        self._excluded = 0.0

    def start(
        self,
        step: int,
        *,
        total_steps: int | None,
        device: torch.device | None,
        count_tokens: TokenCounter | None,
        flops_per_token: float | None,
        peak_flops: float | None,
        data_ranks: int | None = None,
    ) -> None:
        """The loop starts at `step` of a budget of `total_steps` optimizer steps (None: unknown, no ETA); each
        micro-batch this rank reads stands for `data_ranks` (default: every rank) micro-batches of equal size."""
        self.data_ranks = self.world_size if data_ranks is None else data_ranks
        self.total_steps = total_steps
        self.device = device
        self.count_tokens = count_tokens
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self._start_time = self._last_time = time.perf_counter()
        self._start_step = self._last_step = step
        self._samples = self._tokens = 0
        self._excluded = 0.0

    def add(self, samples: int, batches: Iterable[Any]) -> None:
        """One optimizer step read `samples` samples of all ranks, in this rank's micro-`batches`."""
        self._samples += samples
        if self.count_tokens is not None:
            self._tokens += sum(self.count_tokens(batch) for batch in batches) * self.data_ranks

    def exclude(self, seconds: float) -> None:
        """Time spent outside training steps (an evaluation, a save): not part of `step_time`."""
        self._excluded += seconds

    def metrics(self, step: int) -> dict[str, float]:
        """The columns of a log line at `step`; starts the next interval."""
        now = time.perf_counter()
        steps = step - self._last_step
        wall = max(now - self._last_time, 1e-9)
        metrics = {"steps_per_s": steps / wall}
        if steps > 0:
            busy = max(wall - self._excluded, 1e-9)
            metrics["step_time"] = busy / steps
            metrics["samples_per_s"] = self._samples / busy
            if self.count_tokens is not None:
                tokens_per_s = self._tokens / busy
                metrics["tokens_per_s"] = tokens_per_s
                if self.flops_per_token and self.peak_flops:
                    metrics["mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)
        metrics["peak_memory_mib"] = peak_memory_mib(self.device)
        eta = self.eta(step, now)
        if eta is not None:
            metrics["eta_s"] = eta
        self._last_time, self._last_step = now, step
        self._samples = self._tokens = 0
        self._excluded = 0.0
        return metrics

    def eta(self, step: int, now: float | None = None) -> float | None:
        """Seconds until `total_steps` at this attempt's pace so far, or None (no budget in steps, no step yet)."""
        done = step - self._start_step
        if self.total_steps is None or done <= 0:
            return None
        elapsed = (time.perf_counter() if now is None else now) - self._start_time
        return max(self.total_steps - step, 0) * elapsed / done


def peak_memory_mib(device: torch.device | None) -> float:
    """Peak memory of this process so far, in MiB: the CUDA caching allocator's peak of allocated memory on a GPU
    (no device sync), else the peak resident set size."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def format_metric(name: str, value: float) -> str:
    """A metric as a log line shows it: `eta 0:01:23` for `eta_s`, else `name value` with 6 significant digits."""
    if name == "eta_s":
        return f"eta {timedelta(seconds=round(value))}"
    return f"{name} {value:.6g}"


def model_device(module: torch.nn.Module) -> torch.device | None:
    """The device of a module's first parameter or buffer (what memory is measured on), or None."""
    for tensor in module.parameters():
        return tensor.device
    for buffer in module.buffers():
        return buffer.device
    return None
