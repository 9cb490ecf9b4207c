"""Fitting read weights to the model: mapped from the Hugging Face layout (`in_model_layout`), tied parameters that
`save_pretrained` leaves out filled in (`with_tied`), and refused by name when their names or shapes do not fit
(`check_weights_fit`). Reading them is the read path's (`read.py`: `read_weights`, `open_weight_slices`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.hf_read import is_hf_source
from perdure.errors import WeightsMisfitError

MISMATCHES_SHOWN = 5  # the first few missing / unexpected / mis-shaped keys named in a refusal


def in_model_layout(weights: dict[str, torch.Tensor], path: Path, adapter: Any) -> dict[str, torch.Tensor]:
    """`weights` read from `path`, mapped by `adapter.from_hf` (`Runner.state_dict_adapter()`) when they are in the
    Hugging Face layout (`is_hf_source`) and the runner has an adapter; as they are otherwise."""
    if adapter is None or not is_hf_source(Path(path)):
        return weights
    return adapter.from_hf(weights)


def with_tied(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` plus the entries of tied parameters they leave out, as `save_pretrained` leaves out `lm_head.weight`
    when it is the input embedding: a name of `expected` (the model's state dict) missing from `weights` whose
    tensor is the same storage as a present name's gets that name's tensor. Others stay missing (and are refused)."""
    present = {
        (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape): name
        for name, tensor in expected.items()
        if name in weights and tensor.device.type != "meta" and tensor.numel()
    }
    filled = dict(weights)
    for name, tensor in expected.items():
        if name in weights or tensor.device.type == "meta" or not tensor.numel():
            continue
        twin = present.get((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape))
        if twin is not None:
            filled[name] = weights[twin]
    return filled


def check_weights_fit(
    model_name: str,
    expected: Mapping[str, tuple[int, ...] | None],
    given: Mapping[str, tuple[int, ...] | None],
    source: Path,
    *,
    unexpected_too: bool = True,
) -> None:
    """Refuse weights whose names and shapes (`given`, None for an entry that is no tensor) do not fit the model's
    (`expected`) with a WeightsMisfitError naming the missing, unexpected and mis-shaped keys (the first few of each,
    and how many). Shapes only: it runs on a file's metadata before any tensor is read. `unexpected_too`: False when
    `expected` is part of the model (a pipeline stage), whose other parts hold the keys it lacks."""
    missing = [key for key in expected if key not in given]
    unexpected = [key for key in given if key not in expected] if unexpected_too else []
    shapes = [
        f"{key} {given[key]} (model: {expected[key]})"
        for key in expected
        if key in given and given[key] is not None and given[key] != expected[key]
    ]
    problems = []
    for what, items in (("missing", missing), ("unexpected", unexpected), ("with another shape", shapes)):
        if items:
            shown = ", ".join(items[:MISMATCHES_SHOWN]) + (", ..." if len(items) > MISMATCHES_SHOWN else "")
            problems.append(f"{len(items)} {what}: {shown}")
    if problems:
        raise WeightsMisfitError(
            f"the weights in {source} do not fit {model_name}: {'; '.join(problems)}. Give weights of the "
            "same architecture (a checkpoint or model.pth of this model)"
        )
