"""Snapshots: a copy of a checkpoint's state that training may run on past while it is written.

Tensors that only the optimizer step changes (parameters, optimizer state, EMA shadows) are copied while the next
forward / backward run; the runner orders the optimizer step after those copies (`Snapshot.fence`). Every other tensor
(buffers such as BatchNorm statistics change in the forward) and all plain data are copied before the loop goes on.
CPU tensors are copied by a background thread; GPU tensors go to pinned host buffers on a dedicated CUDA stream, and
the loop waits for them on the device, not on the host (see staging.py for the policy and its fallbacks).
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoints.staging import CopyFence, Staging


def is_dtensor(tensor: Any) -> bool:
    """A sharded tensor (FSDP2, tensor parallelism), whose snapshot copies this rank's shard and keeps the layout.
    `torch.distributed.tensor` is looked up, never imported (half a second per process): if no one loaded it, no
    DTensor exists."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (what it saves and copies), else the tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    tensor = local_part(tensor)
    return (tensor.device.type, tensor.untyped_storage().data_ptr())


class BufferPool:
    """Host buffers of past snapshots, reused by the next one; their kind (shared, pinned) follows `staging`.

    A fresh 1 GB buffer costs a page fault per 4 KB page on its first write, about as much as the copy itself, and a
    pinned one far more; a reused one does not. Buffers come back only once their save is committed (or dropped), so a
    buffer is never written while it is being read. The pool keeps about one snapshot's worth of memory between saves.
    """

    def __init__(self, shared_memory: bool = False, staging: Staging | None = None) -> None:
        self.staging = staging or Staging(shared=shared_memory)
        self.shared_memory = self.staging.shared
        self._free: dict[tuple[tuple[int, ...], torch.dtype, bool], list[torch.Tensor]] = {}
        self._pinned: set[int] = set()  # data pointers of the pinned buffers this pool made
        self._lock = threading.Lock()

    def take(self, source: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A buffer shaped like `source`, and whether it is pinned (then the copy may be asynchronous)."""
        shape, dtype = tuple(source.shape), source.dtype
        wanted = self.staging.wants_pinned(source)
        with self._lock:
            for pinned in (True, False) if wanted else (False,):
                free = self._free.get((shape, dtype, pinned))
                if free:
                    return free.pop(), pinned
        buffer, pinned = self.staging.allocate(shape, dtype, wanted)
        if pinned:
            with self._lock:
                self._pinned.add(buffer.data_ptr())
        return buffer, pinned

    def give_back(self, buffers: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                pinned = buffer.numel() > 0 and buffer.data_ptr() in self._pinned
                self._free.setdefault((tuple(buffer.shape), buffer.dtype, pinned), []).append(buffer)


class Snapshot:
    """Copies of `replicated` and `local` state trees; `fence()` orders the optimizer step after the copies of what it
    changes, `wait()` returns once every copy is complete."""

    def __init__(
        self,
        replicated: dict[str, Any],
        local: dict[str, Any],
        *,
        deferred: Iterable[torch.Tensor] = (),
        shared_memory: bool = False,
        pool: BufferPool | None = None,
    ) -> None:
        self._deferred_keys = {storage_key(t) for t in deferred}
        self._pool = pool or BufferPool(shared_memory)
        self.buffers: list[torch.Tensor] = []  # every buffer this snapshot holds, to give back to the pool
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # copied by the background thread
        self._device_now: list[tuple[torch.Tensor, torch.Tensor]] = []  # into pinned buffers, before the loop goes on
        self._device_later: list[tuple[torch.Tensor, torch.Tensor]] = []  # into pinned buffers, before the step
        self.nbytes = 0
        self.replicated = self._copy_tree(replicated)
        self.local = self._copy_tree(local)
        ordered, self._unordered = self._pool.staging.start_copies(self._device_now, self._device_later)
        self._fences: list[CopyFence] = ordered + self._unordered
        self._device_now, self._device_later = [], []
        self._done = threading.Event()
        self._error: BaseException | None = None
        if self._pending:
            threading.Thread(target=self._copy_pending, name="perdure-snapshot", daemon=True).start()
        else:
            self._done.set()

    def fence(self) -> None:
        """Order the coming optimizer step after every copy of what it changes: GPU copies on the device (the current
        stream waits for their event; the host goes on), the background thread's copies on the host. Re-raises a
        copy failure."""
        for fence in self._unordered:
            fence.order_before_mutation()
        self._unordered = []
        self._done.wait()
        if self._error is not None:
            raise self._error

    def wait(self) -> None:
        """Block until every tensor is copied; re-raise a copy failure. The buffers may be read afterwards."""
        for fence in self._fences:
            fence.wait()
        self._done.wait()
        if self._error is not None:
            raise self._error

    @property
    def done(self) -> bool:
        return self._done.is_set() and all(fence.done() for fence in self._fences)

    def _copy_tree(self, tree: Any) -> Any:
        if isinstance(tree, torch.Tensor):
            return self._copy_tensor(tree)
        if isinstance(tree, dict):
            return {key: self._copy_tree(value) for key, value in tree.items()}
        if isinstance(tree, (list, tuple)):
            copied = [self._copy_tree(value) for value in tree]
            return copied if isinstance(tree, list) else tuple(copied)
        return copy.deepcopy(tree)

    def _copy_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if is_dtensor(tensor):
            from torch.distributed.tensor import DTensor

            shard = self._copy_tensor(tensor.to_local())
            layout = {"shape": tensor.shape, "stride": tensor.stride(), "run_check": False}
            return DTensor.from_local(shard, tensor.device_mesh, tensor.placements, **layout)
        tensor = tensor.detach()
        target, pinned = self._pool.take(tensor)
        self.buffers.append(target)
        self.nbytes += tensor.numel() * tensor.element_size()
        deferred = storage_key(tensor) in self._deferred_keys
        if pinned:
            (self._device_later if deferred else self._device_now).append((target, tensor))
        elif deferred:
            self._pending.append((target, tensor))
        else:
            target.copy_(tensor)
        return target

    def _copy_pending(self) -> None:
        try:
            for target, source in self._pending:
                # A GPU tensor lands here only without a pinned buffer: a synchronous copy, on this thread's stream.
                target.copy_(source)
        except BaseException as error:  # reported to the thread that waits
            self._error = error
        finally:
            self._pending.clear()
            self._done.set()


def snapshot_nbytes(trees: Iterable[Any]) -> int:
    """Bytes of every tensor in some state trees (what a snapshot of them would allocate)."""
    total = 0
    stack = list(trees)
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            item = local_part(item)
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def available_memory() -> int:
    """Bytes this process can still allocate: MemAvailable, capped by a cgroup v2 limit when one is set."""
    available = None
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    for headroom in _cgroup_headrooms():
        available = headroom if available is None else min(available, headroom)
    return available if available is not None else 0


def _cgroup_headrooms() -> list[int]:
    """Limit minus usage of this process's memory cgroup and its ancestors (cgroup v2 and v1), where one is set."""
    headrooms = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return headrooms
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: /sys/fs/cgroup/<path>/memory.max and memory.current
            base, limit_name, usage_name = Path("/sys/fs/cgroup"), "memory.max", "memory.current"
        elif "memory" in controllers.split(","):  # v1
            base = Path("/sys/fs/cgroup/memory")
            limit_name, usage_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        directory = base / path.lstrip("/")
        while True:
            try:
                limit = (directory / limit_name).read_text().strip()
                if limit != "max" and int(limit) < 2**60:
                    headrooms.append(int(limit) - int((directory / usage_name).read_text()))
            except (OSError, ValueError):
                pass
            if directory == base:
                break
            directory = directory.parent
    return headrooms
