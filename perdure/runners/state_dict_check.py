"""The check, before the first step, that the model's state can be saved and loaded back (a state-dict round trip).

Every backend saves the model through its own `state_dict()` and restores it through `load_state_dict()`
(`perdure.checkpoints.module_state`), hooks included. A model whose hooks fail, produce something a checkpoint cannot
hold, produce keys its load hooks do not take back, or take them back into other values (a fused tensor reassembled in
another order) would fail at its first checkpoint or, worse, at its first resume. The runner takes the state dict,
loads it back and takes it again once, when the model is in place; a difference stops the run at start-up with the
module and the reason. It holds no copy of the state: each tensor is kept as its dtype, shape and a digest of its bytes
(taken one tensor at a time, on the host), and the state dict itself is what is loaded back. The round trip goes piece
by piece (`perdure/checkpoints/state_pieces.py`), so what state-dict hooks make (a fused weight split whole, gathered)
is held for one hooked module at a time, never for the whole model.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from perdure.checkpoints.state_pieces import StatePiece, state_pieces
from perdure.distributed.collectives import all_ranks
from perdure.errors import CheckpointStateError
from perdure.private_api import load_own_state
from perdure.runners.pipeline import ModelParts
from perdure.runners.zero3_pretrained import hooks_run_whole

FIX = "fix the model's state-dict hooks (state_dict() must give what load_state_dict() takes back, unchanged)"


def check_state_dict_round_trip(model: nn.Module) -> None:
    """Save `model`'s state dict as checkpoints do, load it back and compare: refuse (CheckpointStateError naming the
    module and the reason) a model whose state does not come back bit for bit. Collective where the model is sharded
    (every rank calls it); leaves the model's values as they were when the round trip holds."""
    for part in model if isinstance(model, ModelParts) else [model]:
        _check_part(part)


def _check_part(model: nn.Module) -> None:
    changed: list[str] = []
    for piece in state_pieces(model):  # what hooks make, one hooked module at a time (state_pieces.py)
        with hooks_run_whole(piece):  # ZeRO-3 partitions: a hooked module's parameters gathered whole
            changed += _check_piece(model, piece)
    if all_ranks(not changed):
        return
    if not changed:
        raise CheckpointStateError(f"the model's state dict does not come back unchanged on another rank; {FIX}")
    owner = _owner(model, changed[0])
    raise CheckpointStateError(
        f"the model's state dict does not come back unchanged: {len(changed)} of its entries differ after loading it "
        f"back ({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}), in {owner}; "
        f"a checkpoint of it would resume another model: {FIX}"
    )


def _check_piece(model: nn.Module, piece: StatePiece) -> list[str]:
    """The round trip of one piece of `model`'s state dict: its entries taken, loaded back (a hooked module through
    its own `load_state_dict`, strictly; another module's own tensors through its `_load_from_state_dict`, its load
    pre-hooks included, as `load_state_dict` calls it) and taken again; the keys whose entries differ."""
    try:
        state = piece.state()
        before = {key: _fingerprint(key, value) for key, value in state.items()}
    except CheckpointStateError:
        raise
    except Exception as error:
        where = _failing_module(model)
        raise CheckpointStateError(
            f"the model's state cannot be saved: state_dict() of {where} raised {type(error).__name__}: {error}; {FIX}"
        ) from error
    try:  # its own tensors: a load that writes them back in place changes nothing
        if piece.hooked:
            piece.load(state)
        else:
            _load_own(piece, state)
    except Exception as error:
        raise CheckpointStateError(
            f"the model's state dict does not load back into it: load_state_dict() of {type(model).__name__} raised "
            f"{type(error).__name__}: {error}; {FIX}"
        ) from error
    del state
    after = piece.state()
    changed = [key for key, value in before.items() if key not in after or value != _fingerprint(key, after[key])]
    return changed + [key for key in after if key not in before]


def _load_own(piece: StatePiece, state: dict[str, Any]) -> None:
    """Load a module's own entries (a piece that is no hooked module) back into it, strictly, without its children."""
    module = piece.module
    raw = {piece.prefix + piece.names[key]: value for key, value in state.items()}
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []
    load_own_state(module, raw, piece.prefix, missing, unexpected, errors)
    if missing or unexpected or errors:
        problems = [*errors, *(f"missing {key}" for key in missing), *(f"unexpected {key}" for key in unexpected)]
        raise RuntimeError("; ".join(problems))


def _fingerprint(key: str, value: Any) -> Any:
    """What is compared of an entry: a tensor's dtype, shape and a digest of its bytes (a DTensor's local shard; one
    tensor at a time on the host, so no copy of the whole state is held); another value's type, after checking that
    torch.save writes it."""
    if isinstance(value, torch.Tensor):
        tensor = value.to_local() if isinstance(value, DTensor) else value
        local = tensor.detach().cpu().contiguous()
        data = local.reshape(-1).view(torch.uint8).numpy()
        digest = hashlib.blake2b(data, digest_size=32).digest()  # type: ignore[arg-type]  # numpy's stubs: a buffer
        return (tensor.dtype, tuple(tensor.shape), digest)
    try:
        torch.save(value, io.BytesIO())
    except Exception as error:
        raise CheckpointStateError(
            f"the model's state dict holds {key!r} = a {type(value).__name__} that torch.save cannot write "
            f"({type(error).__name__}: {error}); {FIX}"
        ) from error
    return type(value)


def _failing_module(model: nn.Module) -> str:
    """The deepest submodule whose own `state_dict()` raises, as `name (Class)`."""
    for name, module in reversed(list(model.named_modules())):
        try:
            module.state_dict()
        except Exception:  # noqa: BLE001 - looking for where it fails, the caller reports the error itself
            return f"{name or 'the model'} ({type(module).__name__})"
    return f"the model ({type(model).__name__})"


def _owner(model: nn.Module, key: str) -> str:
    """The deepest submodule whose name prefixes state-dict key `key`, as `name (Class)`."""
    modules = dict(model.named_modules())
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:end])
        if name in modules:
            return f"{name} ({type(modules[name]).__name__})"
    return f"the model ({type(model).__name__})"
