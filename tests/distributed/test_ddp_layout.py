"""The DDP wrapping rule in plain torch (issue 17): a fresh DistributedDataParallel wrap of the same weights and
optimizer state continues bit for bit, on 4 gloo ranks, as a resumed process does.

Plain DDP starts each wrap with one bucket in definition order and rebuilds it in gradient-ready order after the first
iteration; a gloo ring all-reduce over more than two ranks sums each element in an order that depends on its position
in the bucket, so the first step after a fresh wrap differs from the uninterrupted run's step in the last bit.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from perdure.distributed.ddp import FixedLayoutDDP
from tests.distributed.gloo_ranks import run_on_gloo_ranks

STEPS = 20
WRAPPERS = {"perdure": FixedLayoutDDP, "plain torch": DistributedDataParallel}

pytestmark = pytest.mark.timeout(180)


def _model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> None:
    for inputs, target in batches:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(inputs), target).backward()
        optimizer.step()


def continue_in_a_fresh_wrap(rank: int, world_size: int) -> dict[str, list[bool]]:
    """For each wrapper: STEPS steps in one wrap versus STEPS / 2, then a fresh model and optimizer loaded from their
    state dicts and wrapped anew for the rest; whether each final parameter is equal."""
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(8, 16, generator=generator), torch.randint(0, 2, (8,), generator=generator))
               for _ in range(STEPS)]  # fmt: skip
    equal = {}
    for name, wrapper in WRAPPERS.items():
        uninterrupted, optimizer = _model_and_optimizer()
        _train(wrapper(uninterrupted), optimizer, batches)
        before, before_optimizer = _model_and_optimizer()
        _train(wrapper(before), before_optimizer, batches[: STEPS // 2])
        after, after_optimizer = _model_and_optimizer()
        after.load_state_dict(before.state_dict())
        after_optimizer.load_state_dict(before_optimizer.state_dict())
        _train(wrapper(after), after_optimizer, batches[STEPS // 2 :])
        equal[name] = [torch.equal(a, b) for a, b in zip(uninterrupted.parameters(), after.parameters())]
    return equal


def test_a_fresh_wrap_continues_bit_for_bit_on_four_ranks():
    for rank, equal in enumerate(run_on_gloo_ranks(4, continue_in_a_fresh_wrap)):
        assert all(equal["perdure"]), f"rank {rank}: parameters {equal['perdure']} after a fresh FixedLayoutDDP wrap"
        # The control: the same experiment with plain DDP differs, so this test can tell the two rules apart.
        assert not all(equal["plain torch"]), "plain DDP continued bit for bit: the experiment lost its power"
