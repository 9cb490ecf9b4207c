"""Throughput columns of the train log lines: what they compute, the peak FLOPs table, and a run's log file and
metrics.csv holding them."""

from __future__ import annotations

import pytest
import torch

import perdure.runners.throughput as throughput
from perdure.loggers.metrics_csv import read_metrics_csv
from perdure.runners.peak_flops import device_peak_flops, table_peak
from perdure.runners.throughput import ThroughputMeter, format_metric
from tests.scripts.resumable import ResumableRunner, make_config


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_meter_computes_rates_from_counts_and_excludes_evaluation_time(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(throughput.time, "perf_counter", clock)
    meter = ThroughputMeter(world_size=2)
    meter.start(0, total_steps=100, device=torch.device("cpu"), count_tokens=lambda batch: 10, flops_per_token=6.0,
                peak_flops=50.0)  # fmt: skip
    for _ in range(10):
        meter.add(16, ["batch"])  # 8 samples per rank, 10 tokens per micro-batch
    meter.exclude(1.0)  # an evaluation took a second
    clock.now += 3.0
    metrics = meter.metrics(10)
    assert metrics["steps_per_s"] == pytest.approx(10 / 3)
    assert metrics["step_time"] == pytest.approx(0.2)
    assert metrics["samples_per_s"] == pytest.approx(160 / 2)
    assert metrics["tokens_per_s"] == pytest.approx(10 * 10 * 2 / 2)
    assert metrics["mfu"] == pytest.approx(100 * 6.0 / (50.0 * 2))
    assert metrics["eta_s"] == pytest.approx(90 * 3 / 10)
    assert metrics["peak_memory_mib"] > 10
    clock.now += 2.0
    meter.add(16, ["batch"])
    assert meter.metrics(11)["step_time"] == pytest.approx(2.0)  # the next interval starts afresh


def test_without_token_counts_or_flops_there_are_no_token_or_mfu_columns():
    meter = ThroughputMeter()
    meter.start(5, total_steps=None, device=None, count_tokens=None, flops_per_token=None, peak_flops=None)
    meter.add(4, [None])
    metrics = meter.metrics(6)
    assert set(metrics) == {"steps_per_s", "step_time", "samples_per_s", "peak_memory_mib"}


def test_eta_is_shown_as_a_duration():
    assert format_metric("eta_s", 3725.4) == "eta 1:02:05"
    assert format_metric("step_time", 0.0123456789) == "step_time 0.0123457"


@pytest.mark.parametrize(
    "name, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
        ("NVIDIA A10G", "bf16", 125),
        ("NVIDIA L4", "bf16", 121),
        ("NVIDIA L40S", "bf16", 362.05),
        ("Tesla V100-SXM2-32GB", "fp16", 125),
        ("Tesla V100-PCIE-16GB", "fp16", 112),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("NVIDIA GeForce RTX 3090", "bf16", 71),
    ],
)
def test_peak_flops_table(name, dtype, tflops):
    assert table_peak(name, dtype) == pytest.approx(tflops * 1e12)


def test_no_peak_without_a_table_entry_or_a_configured_one():
    assert table_peak("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 tensor cores
    assert table_peak("Some Future GPU", "bf16") is None
    assert device_peak_flops(torch.device("cpu"), "fp32", None) is None
    assert device_peak_flops(torch.device("cpu"), "fp32", 2e11) == 2e11


class CountingRunner(ResumableRunner):
    def batch_tokens(self, batch):
        return batch[0].numel()  # 16 features per sample count as tokens here

    def flops_per_token(self):
        return 6.0 * sum(p.numel() for p in self.model.parameters()) / 16


def test_a_runs_log_file_and_metrics_csv_hold_the_throughput_columns(tmp_path):
    settings = {"steps": 20, "log.interval": 10, "log.progress": "lines", "perf.peak_flops": 1e9}
    runner = CountingRunner(make_config(tmp_path, **settings))
    runner.train()
    (log,) = (runner.run_dir.path / "logs").glob("*.log")
    lines = [line for line in log.read_text().splitlines() if " train: " in line]
    assert len(lines) == 2
    for column in ("steps_per_s", "step_time", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_mib", "eta "):
        assert all(f" {column}" in line for line in lines), (column, lines)
    rows = {(step, name): value for step, split, name, value in read_metrics_csv(runner.run_dir.path / "metrics.csv")
            if split == "train"}  # fmt: skip
    for step in (10, 20):
        tokens, samples = rows[(step, "tokens_per_s")], rows[(step, "samples_per_s")]
        assert tokens == pytest.approx(16 * samples)
        assert rows[(step, "mfu")] == pytest.approx(tokens * runner.flops_per_token() / 1e9)
        assert rows[(step, "step_time")] > 0 and rows[(step, "peak_memory_mib")] > 0
    assert rows[(20, "eta_s")] == 0.0 and rows[(10, "eta_s")] > 0
