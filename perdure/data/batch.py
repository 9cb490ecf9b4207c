"""Small facts about a batch of any layout the default collate produces."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def batch_length(batch: Any) -> int:
    """Samples in a batch: the leading dimension of its first tensor (in a tensor, tuple, list or mapping)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        return batch_length(next(iter(batch.values()))) if batch else 1
    if isinstance(batch, (tuple, list)) and batch:
        return batch_length(batch[0])
    return 1
