"""The state-dict adapter contract: how a model's own parameter names map to and from the Hugging Face layout.

A model whose state dict already uses the Hugging Face names (any `transformers.PreTrainedModel`) needs none. Any
other model (TorchTitan's Llama with its fused or differently named weights, a model of your own) returns one from
`Runner.state_dict_adapter()`; the `hf` export calls `to_hf`, and reading a Hugging Face checkpoint (`--pretrained`
of a `save_pretrained` directory or a safetensors file) calls `from_hf`.

The shape is TorchTitan's state-dict adapters' (`torchtitan.protocols.state_dict_adapter.StateDictAdapter`): an
instance of TorchTitan's `Llama3StateDictAdapter` satisfies this protocol as it is.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StateDictAdapter(Protocol):
    """Maps full (unsharded) state dicts between the model's names and the Hugging Face names.

    Both methods are pure functions of their argument: they return a new dict and neither modify the dict they are
    given nor touch the model, the optimizer or any file. They may rename, split (one fused `qkv` into `q_proj`,
    `k_proj`, `v_proj`), concatenate, permute or transpose tensors, and must map every key: a key left out is a
    weight missing from the export (or from the model), which perdure refuses by name.
    """

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's state dict (names as `model.state_dict()` gives them) in the Hugging Face layout. Called on the
        main process by the `hf` export (end of training, `perdure ckpt export --format hf`), once for the model's
        weights and once for the EMA weights, with CPU tensors."""
        ...

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A Hugging Face state dict (names as in its safetensors files) in the model's layout: the inverse of
        `to_hf`. Called when weights in a Hugging Face format are read into this model (`--pretrained`)."""
        ...
