"""DistributedDataParallel whose gradient bucket layout is the same in every step of every process.

Plain DDP starts a fresh wrap with every parameter in one bucket, in definition order, and after the first iteration
rebuilds its buckets in the order the gradients became ready. A resumed process therefore reduces its first step in
another layout than the uninterrupted run reduced the same step. With more than two ranks that changes the sums: a
ring all-reduce splits the flat bucket into one chunk per rank and adds each chunk's contributions starting from a
different rank, so an element's summation order follows its position in the bucket, and a moved element comes out one
ulp away. (Two ranks add two numbers, which commutes: that case was always exact.)

`FixedLayoutDDP` fixes the layout before the first forward, from the model's definition alone: the parameters in
reverse definition order (the order a network's backward usually produces their gradients, so the first bucket is
ready first and its all-reduce overlaps the rest of the backward, as with torch's own rebuild), split by DDP's usual
bucket caps. The layout is identical in every process that wraps the same model, started fresh or resumed, and DDP
never rebuilds it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from perdure.private_api import push_all_rebuilt_params


class FixedLayoutDDP(DistributedDataParallel):
    """DistributedDataParallel with the bucket layout fixed at construction (see the module docstring).

    Takes DDP's arguments. Numerically, every step reduces as plain DDP's steps after its first iteration do whenever
    the backward produces gradients in reverse definition order; only the layout of the first step differs.
    """

    def __init__(self, module: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        # Marks every parameter as "seen" in index order, so the reducer rebuilds its buckets from that order at the
        # first forward (before any all-reduce) instead of from the first backward's order after it; a reducer that
        # never rebuilds (find_unused_parameters without static_graph) keeps its initial layout, fixed as well.
        push_all_rebuilt_params(self.reducer)

    def _build_params_for_reducer(self) -> tuple[list[torch.nn.Parameter], list[bool]]:
        # Overrides DDP's private _build_params_for_reducer (torch 2.13): a method of the subclass, which no function of
        # perdure/private_api.py can stand for; tests/distributed/test_ddp_layout.py fails when torch changes it.
        # The reducer's parameter indices, in reverse definition order: the order the layout is built from.
        parameters, expect_sparse_gradient = super()._build_params_for_reducer()
        return parameters[::-1], expect_sparse_gradient[::-1]
