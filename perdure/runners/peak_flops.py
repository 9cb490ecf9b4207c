"""Peak FLOP/s of common GPUs, the denominator of MFU (model FLOPs utilisation).

Dense numbers (no 2:4 sparsity), in FLOP/s per GPU, from NVIDIA's datasheets and architecture whitepapers: the H100
and H200 datasheets (SXM, PCIe and NVL forms), the A100 datasheet, the A10, L4, L40 and L40S datasheets,
the V100 and T4 datasheets, and the Ampere GA102 / Ada AD102 whitepapers for the GeForce cards (tensor throughput
with FP32 accumulate, which is what training uses). Datasheets print the sparse figure for tensor cores; the table
holds half of it. NVIDIA publishes no datasheet for the A10G (an AWS part); it is listed with the A10's figures, which
is what cloud providers quote for it. `tf32` is used for fp32 training when TF32 matmuls are on
(`torch.set_float32_matmul_precision("high")`), else `fp32` (no tensor cores).

Where the device is not in the table (a CPU, another GPU) MFU is reported only when `perf.peak_flops` is set.
"""

from __future__ import annotations

import torch

TERA = 1e12

# name pattern (matched against the lower-cased CUDA device name, first match wins) -> {dtype: dense FLOP/s}
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("h200 nvl", {"fp32": 60 * TERA, "tf32": 417.5 * TERA, "bf16": 835.5 * TERA, "fp16": 835.5 * TERA}),
    ("h200", {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA, "fp16": 989.4 * TERA}),
    ("h100 nvl", {"fp32": 60 * TERA, "tf32": 417.5 * TERA, "bf16": 835.5 * TERA, "fp16": 835.5 * TERA}),
    ("h100 pcie", {"fp32": 51 * TERA, "tf32": 378 * TERA, "bf16": 756 * TERA, "fp16": 756 * TERA}),
    ("h100", {"fp32": 67 * TERA, "tf32": 494.7 * TERA, "bf16": 989.4 * TERA, "fp16": 989.4 * TERA}),  # SXM
    ("a100", {"fp32": 19.5 * TERA, "tf32": 156 * TERA, "bf16": 312 * TERA, "fp16": 312 * TERA}),
    ("a10g", {"fp32": 31.2 * TERA, "tf32": 62.5 * TERA, "bf16": 125 * TERA, "fp16": 125 * TERA}),
    ("a10", {"fp32": 31.2 * TERA, "tf32": 62.5 * TERA, "bf16": 125 * TERA, "fp16": 125 * TERA}),
    ("l40s", {"fp32": 91.6 * TERA, "tf32": 183 * TERA, "bf16": 362.05 * TERA, "fp16": 362.05 * TERA}),
    ("l40", {"fp32": 90.5 * TERA, "tf32": 90.5 * TERA, "bf16": 181.05 * TERA, "fp16": 181.05 * TERA}),
    ("l4", {"fp32": 30.3 * TERA, "tf32": 60 * TERA, "bf16": 121 * TERA, "fp16": 121 * TERA}),
    ("v100-pcie", {"fp32": 14 * TERA, "fp16": 112 * TERA}),
    ("v100", {"fp32": 15.7 * TERA, "fp16": 125 * TERA}),  # SXM2
    ("tesla t4", {"fp32": 8.1 * TERA, "fp16": 65 * TERA}),
    ("rtx 4090", {"fp32": 82.6 * TERA, "tf32": 82.6 * TERA, "bf16": 165.2 * TERA, "fp16": 165.2 * TERA}),
    ("rtx 3090", {"fp32": 35.6 * TERA, "tf32": 35.6 * TERA, "bf16": 71 * TERA, "fp16": 71 * TERA}),
)


def table_peak(device_name: str, dtype: str) -> float | None:
    """The table's dense peak for a device name (as `torch.cuda.get_device_name` prints it) and a training dtype
    (`fp32`, `tf32`, `bf16`, `fp16`), or None when the device or that dtype is not in the table."""
    name = device_name.lower()
    for pattern, peaks in PEAK_FLOPS:
        if pattern in name:
            return peaks.get(dtype)
    return None


def training_dtype(precision: str) -> str:
    """The dtype the matmuls of a run use: bf16 / fp16 autocast, else tf32 when TF32 matmuls are on, else fp32."""
    if precision in ("bf16", "fp16"):
        return precision
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def device_peak_flops(device: torch.device | None, precision: str, configured: float | None) -> float | None:
    """Peak FLOP/s of one device for MFU: `perf.peak_flops` when set, else the table's for a CUDA device, else None
    (no MFU on a CPU or an unknown GPU without `perf.peak_flops`)."""
    if configured:
        return float(configured)
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return table_peak(torch.cuda.get_device_name(device), training_dtype(precision))
