"""Importing DeepSpeed the way perdure runs it: the accelerator chosen before the import, no comm op compiled.

DeepSpeed picks its accelerator when it is first imported (`DS_ACCELERATOR`, else by probing); on a machine without
CUDA perdure sets `cpu`, where DeepSpeed talks through torch's gloo process group. Its CPU backend would JIT-compile a
shared-memory all-reduce op with g++ on first use (about 60 s); perdure marks that op unavailable, so gloo carries
every collective and nothing is ever compiled.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

from perdure.errors import ConfigError, PerdureError
from perdure.private_api import disable_deepspeed_op

SHM_COMM_OP = "deepspeed_shm_comm"


def import_deepspeed() -> ModuleType:
    """`deepspeed`, imported once with the accelerator set and the shared-memory comm op disabled."""
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as error:
        raise PerdureError(
            f"stack=deepspeed needs DeepSpeed ({error}); install it with "
            "DS_BUILD_OPS=0 pip install 'perdure[deepspeed]'"
        ) from None
    disable_deepspeed_op(SHM_COMM_OP)  # read by DeepSpeed's comm backend when it initialises
    # DeepSpeed 0.19.8 gathers and scatters ZeRO partitions with collectives torch 2.13 calls deprecated, warning at
    # every step: DeepSpeed's warnings, not the user's.
    warnings.filterwarnings(
        "ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning, module="torch.distributed"
    )
    return deepspeed


def check_precision(precision: str) -> None:
    """Refuse `precision` fp16 where DeepSpeed's accelerator has no fp16 support, before anything is written (the engine
    would fail at construction with "Type fp16 is not supported on your device"). On a CPU, DeepSpeed supports fp16
    only where oneDNN has fp16 kernels (AVX512-FP16 or AMX-FP16)."""
    if precision != "fp16":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        raise ConfigError(
            "precision",
            precision,
            f"DeepSpeed's {accelerator.device_name()} accelerator has no fp16 support on this machine (on a CPU it "
            "needs oneDNN fp16 kernels: AVX512-FP16 or AMX-FP16); use precision bf16 or fp32",
        )
