"""The few collectives the runner's agreement needs. Each is a no-op in a single process.

Every decision that changes control flow (stop after a signal, skip a step, where to resume from) goes through one
of these, so all ranks take the same branch; the process group's timeout keeps a missing rank from hanging the rest.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_object(value: T, src: int = 0) -> T:
    """`value` as rank `src` has it, on every rank."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def all_gather_object(value: Any) -> list[Any]:
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def max_over_ranks(value: int) -> int:
    """The largest of an integer over all ranks, on every rank."""
    return max_each_over_ranks([value])[0]


def max_each_over_ranks(values: list[int]) -> list[int]:
    """Element-wise largest of a list of integers over all ranks, on every rank (one collective)."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(value) for value in tensor.tolist()]


def host_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank, made now (a collective: every rank calls this at the same point), for collectives
    on host tensors that run beside the training's: reading a result never waits for a GPU, and one left pending
    never holds a worker thread of the group the training's own asynchronous collectives use (ZeRO-3's prefetching
    all-gathers on gloo). None without several ranks."""
    if not is_distributed():
        return None
    return dist.new_group(backend="gloo")


class PendingMax:
    """An element-wise largest of integers over all ranks, started now and read later (`result`): the collective
    runs while the caller goes on. Every rank reads the same values; every rank must start it at the same point."""

    def __init__(self, values: list[int], group: dist.ProcessGroup | None) -> None:
        self._tensor = torch.tensor(values, dtype=torch.int64)
        work = dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, group=group, async_op=True)
        assert work is not None  # async_op=True returns the collective's handle
        self._work = work

    def result(self) -> list[int]:
        self._work.wait()
        return [int(value) for value in self._tensor.tolist()]


def any_rank(flag: bool) -> bool:
    """True on every rank when it is True on at least one."""
    return bool(max_over_ranks(1 if flag else 0))


def all_ranks(flag: bool) -> bool:
    """True on every rank only when it is True on all of them."""
    return not any_rank(not flag)


def sum_over_ranks(values: list[float]) -> list[float]:
    """Element-wise sums of a list of numbers over all ranks (float64)."""
    if not is_distributed() or not values:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def max_each_of_floats(values: list[float]) -> list[float]:
    """Element-wise largest of a list of numbers over all ranks (float64), on every rank (one collective): with a
    slot per rank holding that rank's number and a floor elsewhere, every rank's number, for an all-reduce's cost."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def barrier() -> None:
    if is_distributed():
        dist.barrier()
