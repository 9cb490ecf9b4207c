"""Seeding and the per-rank random-number-generator state a checkpoint carries."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("perdure")


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every CUDA device) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derived_seed(seed: int, rank: int, step: int = 0) -> int:
    """A seed for (seed, rank, step): each rank's stream at the start, and the stream of a rank a checkpoint has no
    state for (a resume on more ranks than wrote it). Deterministic, so such a resume is reproducible too."""
    return (seed * 1_000_003 + rank * 7_919 + step * 104_729) % 2**63


class RNGState:
    """Stateful view of every global generator of this process, saved per rank.

    The numpy state is stored as a tensor and plain ints so the checkpoint loads with `torch.load(weights_only=True)`.
    """

    def state_dict(self) -> dict[str, Any]:
        kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": {
                "kind": str(kind),
                "key": torch.from_numpy(np.asarray(key, dtype=np.uint32).astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
            state["cuda_device"] = torch.cuda.current_device()  # the one this process trains on (TorchRunner sets it)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(_as_python_state(state["python"]))
        numpy_state = state["numpy"]
        key = numpy_state["key"].numpy().astype(np.uint32)
        np.random.set_state(
            (
                numpy_state["kind"],
                key,
                numpy_state["pos"],
                numpy_state["has_gauss"],
                numpy_state["cached_gaussian"],
            )
        )
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            restore = cuda_states_to_restore(
                state["cuda"], state.get("cuda_device"), torch.cuda.device_count(), torch.cuda.current_device()
            )
            for device, generator_state in restore:
                torch.cuda.set_rng_state(generator_state, device)


def cuda_states_to_restore(
    saved: list[torch.Tensor], saved_device: int | None, device_count: int, current_device: int
) -> list[tuple[int, torch.Tensor]]:
    """Which saved CUDA generator states go to which device of this process, as (device index, state).

    With as many devices as the saving process saw, each state goes back to its own index (a process that uses several
    devices gets all of them back). With another number (say each rank now sees only its own GPU, where it saw the
    whole node before), the generator of the device the saving process trained on goes to the device this one trains
    on, and the others keep their seeds.
    """
    if len(saved) == device_count:
        return list(enumerate(saved))
    if saved_device is None or not 0 <= saved_device < len(saved):
        logger.warning(
            "the checkpoint holds CUDA generator states of %d devices and this process sees %d, without saying which "
            "one it trained on: the CUDA generators keep their seeds (the resume is not bit-exact on the GPU)",
            len(saved),
            device_count,
        )
        return []
    return [(current_device, saved[saved_device])]


def _as_python_state(state: Any) -> tuple:
    # A python random state round-trips through torch.save as nested tuples or lists; setstate needs tuples.
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
