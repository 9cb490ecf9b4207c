"""Model-only weights: the `model.pth` / `model.safetensors` exports. Reading weights back (`--pretrained`, ...):
`perdure.checkpoints.read.read_weights` (the read path), importable from here too."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from perdure.atomic import atomic_write, atomic_write_by_name
from perdure.checkpoints.export_stream import Planned, stream_order, write_streamed
from perdure.checkpoints.read import read_weights
from perdure.checkpoints.state_pieces import made_by_hooks, own_tensors, state_pieces
from perdure.errors import CheckpointError, ConfigError, PerdureError
from perdure.runners.compile import strip_compile_prefix

__all__ = [
    "EXPORT_DTYPES",
    "cast_weights",
    "StreamSource",
    "export_streamed",
    "module_source",
    "export_weights",
    "read_weights",
    "save_safetensors",
]

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export_weights(state_dict: dict[str, torch.Tensor], path: Path, dtype: str | None = None) -> Path:
    """Atomically write a state dict, casting floating-point tensors to `dtype` (fp32 | bf16 | fp16) when given."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError("ckpt.export_dtype", dtype, f"use one of {', '.join(EXPORT_DTYPES)} or leave it unset")
    target = EXPORT_DTYPES.get(dtype) if dtype else None
    weights = {
        name: (tensor.detach().to("cpu", target) if target and tensor.is_floating_point() else tensor.detach().cpu())
        for name, tensor in strip_compile_prefix(state_dict).items()
    }
    atomic_write(path, lambda file: torch.save(weights, file))
    return path


def cast_weights(weights: dict[str, Any], dtype: str | None) -> dict[str, torch.Tensor]:
    target = EXPORT_DTYPES[dtype] if dtype else None
    out = {}
    for name, tensor in weights.items():
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"weight {name!r} is a {type(tensor).__name__}, not a tensor; safetensors holds tensors"
            )
        tensor = tensor.detach().cpu()
        out[name] = tensor.to(target) if target is not None and tensor.is_floating_point() else tensor
    return out


def save_safetensors(weights: dict[str, Any], path: Path, dtype: str | None, metadata: dict[str, str]) -> Path:
    """Atomically write `weights` as safetensors: cast, contiguous, shared storage cloned, fsynced."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise PerdureError(
            f"writing {path.name} needs the safetensors package: pip install safetensors (or export to .pth)"
        ) from None
    tensors, seen = {}, set()
    for name, tensor in cast_weights(weights, dtype).items():
        storage = tensor.untyped_storage().data_ptr() if tensor.numel() else None
        tensor = tensor.clone() if storage is not None and storage in seen else tensor.contiguous()
        seen.add(storage)
        tensors[name] = tensor
    atomic_write_by_name(path, lambda temporary: save_file(tensors, str(temporary), metadata=metadata))
    return path


@dataclass(frozen=True)
class StreamSource:
    """Weights to stream into an export without holding them whole: each tensor's dtype and whole shape by name
    (known from metadata: a DTensor's global shape, a ZeRO-3 parameter's `ds_shape`), and `whole(name)`, which makes
    that one tensor whole (a collective where it is sharded: every rank calls it, for every name, in the same order)."""

    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    whole: Callable[[str], torch.Tensor]

    @classmethod
    def of_state(cls, state: Mapping[str, Any], whole: Callable[[Any], torch.Tensor]) -> StreamSource:
        """A state dict whose tensors carry their whole shapes (DTensors, plain tensors); `whole(value)`."""
        shapes = {}
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"weight {name!r} is a {type(value).__name__}, not a tensor; an export holds tensors"
                )
            shapes[name] = (value.dtype, tuple(value.shape))
        return cls(shapes, lambda name: whole(state[name]))


def module_source(parts: Sequence[nn.Module], whole: Callable[[Any], torch.Tensor]) -> StreamSource:
    """The state dict of `parts` (each through its hooks, `module_state_dict`'s names) as a `StreamSource` that holds
    what hooks make one hooked module at a time (`checkpoints/state_pieces.py`): the pieces holding the model's own
    tensors are kept as references; a piece a hook made tensors in (a fused weight split whole) is made once to learn
    its names and shapes, dropped, and made again when the stream reaches it (and again should the stream come back
    to it: safetensors' order is by dtype first), its entries dropped as they are taken. `whole(value)` as in
    `StreamSource.of_state`. Every rank builds it and takes the same names in the same order (hooks may gather)."""
    pieces = [piece for part in parts for piece in state_pieces(part)]
    owned = set().union(*(own_tensors(part) for part in parts))
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    where: dict[str, int] = {}
    kept: dict[str, torch.Tensor] = {}
    for index, piece in enumerate(pieces):
        state = piece.state(keep_vars=True)
        made = made_by_hooks(piece, state, owned)
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"weight {name!r} is a {type(value).__name__}, not a tensor; an export holds tensors"
                )
            shapes[name], where[name] = (value.dtype, tuple(value.shape)), index
            if not made:
                kept[name] = value
        del state
    held: dict[str, Any] = {}
    current = [-1]

    def take(name: str) -> torch.Tensor:
        if name in kept:
            return whole(kept[name].detach())
        if current[0] != where[name] or name not in held:
            held.clear()  # the previous hooked piece's entries go before the next piece is made
            current[0] = where[name]
            held.update(pieces[where[name]].state())
        return whole(held.pop(name))

    return StreamSource(shapes, take)


def export_streamed(
    source: StreamSource,
    formats: Sequence[str],
    paths: dict[str, Path] | None,
    dtype: str | None,
    metadata: dict[str, str],
) -> None:
    """Write the export of `source` tensor by tensor (`checkpoints/export_stream.py`): on every rank, since
    `source.whole` may be a collective; `paths` (format -> file) on the rank that writes, None on the others. Floating
    tensors cast to `dtype` as `export_weights` casts; the writing rank holds one whole tensor at a time."""
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ConfigError("ckpt.export_dtype", dtype, f"use one of {', '.join(EXPORT_DTYPES)} or leave it unset")
    target = EXPORT_DTYPES[dtype] if dtype else None
    planned = [
        Planned(name, target if target is not None and kind.is_floating_point else kind, shape)
        for name, (kind, shape) in source.shapes.items()
    ]
    ordered = stream_order(planned, [fmt for fmt in formats if fmt in ("pth", "safetensors")])

    def tensors() -> Iterator[torch.Tensor]:
        for entry in ordered:
            yield source.whole(entry.name).detach().to("cpu", entry.dtype)

    if paths is None:
        for entry in ordered:
            source.whole(entry.name)
        return
    write_streamed(paths, planned, tensors(), metadata)
