"""`deterministic`: the same kernels, so the same bits, in every run and every resume (at some speed)."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("perdure")

# cuBLAS needs a fixed workspace to be deterministic (CUDA >= 10.2); ":16:8" works too, with less memory, more time.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"


def configure_determinism(enabled: bool) -> None:
    """With `enabled`: `torch.use_deterministic_algorithms(True)`, deterministic cuDNN without autotuning, and
    `CUBLAS_WORKSPACE_CONFIG` (unless the environment sets it). Called first in the runner's `__init__`, before the
    process group or anything else can initialise CUDA. Without it nothing is changed, whatever the user set himself.

    An operation without a deterministic implementation then raises (torch names it) instead of varying silently.
    """
    if not enabled:
        return
    if "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        if torch.cuda.is_initialized():
            logger.warning(
                "deterministic: CUDA was initialised before the runner could set CUBLAS_WORKSPACE_CONFIG; cuBLAS may "
                "already run without a fixed workspace. Set CUBLAS_WORKSPACE_CONFIG=%s in the environment instead",
                CUBLAS_WORKSPACE_CONFIG,
            )
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
