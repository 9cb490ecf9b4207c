"""Snapshots: a copy of a checkpoint's state that training may run on past while it is written.

Tensors that only the optimizer step changes (parameters, optimizer state, EMA shadows) are copied while the next
forward / backward run; the runner orders the optimizer step after those copies (`Snapshot.fence`). Every other tensor
(buffers such as BatchNorm statistics change in the forward) and all plain data are copied before the loop goes on.
CPU tensors are copied by a background thread; GPU tensors go to pinned host buffers on a dedicated CUDA stream, and
the loop waits for them on the device, not on the host (see staging.py for the policy and its fallbacks).
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from perdure.checkpoints.save_errors import human_bytes
from perdure.checkpoints.staging import CopyFence, Staging

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(tensor: Any) -> TypeGuard[DTensor]:
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


BufferKind = tuple[tuple[int, ...], torch.dtype]  # shape and dtype: buffers of one kind serve any tensor of it


class BufferPool:
    """Host buffers of past snapshots, reused by the next one; their kind (shared, pinned) follows `staging`.

    A fresh 1 GB buffer costs a page fault per 4 KB page on its first write, about as much as the copy itself, and a
    pinned one far more; a reused one does not. `reserve` makes the buffers of the coming snapshots ahead of time, on
    a background thread, so that no save allocates in the training loop. Buffers come back only once their save is
    committed (or dropped), so a buffer is never written while it is being read.
    """

    def __init__(self, shared_memory: bool = False, staging: Staging | None = None) -> None:
        self.staging = staging or Staging(shared=shared_memory)
        self.shared_memory = self.staging.shared
        self._free: dict[tuple[tuple[int, ...], torch.dtype, bool], list[torch.Tensor]] = {}
        self._pinned: set[int] = set()  # data pointers of the pinned buffers this pool made
        self._made: Counter[BufferKind] = Counter()  # buffers made (or being made), per kind
        self._being_made: Counter[BufferKind] = Counter()  # by the reserving thread, not yet free
        self._reserving: threading.Thread | None = None
        self._condition = threading.Condition()
        self.reserved_nbytes = 0  # made ahead of the saves by `reserve`
        self.reserve_seconds: float | None = None  # how long the last reservation took
        self._report: tuple[int, str] | None = None
        # Made by a snapshot that found no buffer free: time the training loop paid.
        self.on_demand: Counter[BufferKind] = Counter()
        self.on_demand_nbytes = 0

    def take(self, source: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """A buffer shaped like `source`, and whether it is pinned (then the copy may be asynchronous). Waits for one
        the reserving thread is making rather than making a second."""
        shape, dtype = tuple(source.shape), source.dtype
        wanted = self.staging.wants_pinned(source)
        with self._condition:
            while True:
                for pinned in (True, False) if wanted else (False,):
                    free = self._free.get((shape, dtype, pinned))
                    if free:
                        return free.pop(), pinned
                if not self._being_made[(shape, dtype)]:
                    break
                self._condition.wait()
            self._made[(shape, dtype)] += 1
        try:
            buffer, pinned = self._make(shape, dtype, wanted, prefault=False)
        except BaseException:
            with self._condition:
                self._made[(shape, dtype)] -= 1
            raise
        with self._condition:
            self.on_demand[(shape, dtype)] += 1
            self.on_demand_nbytes += buffer.numel() * buffer.element_size()
        return buffer, pinned

    def give_back(self, buffers: Iterable[torch.Tensor]) -> None:
        with self._condition:
            for buffer in buffers:
                pinned = buffer.numel() > 0 and buffer.data_ptr() in self._pinned
                self._free.setdefault((tuple(buffer.shape), buffer.dtype, pinned), []).append(buffer)
            self._condition.notify_all()

    def reserve(self, tensors: Iterable[torch.Tensor], sets: int) -> None:
        """Start making, on a background thread, the buffers `sets` snapshots of `tensors` take (one set first, then
        the next; counting the buffers the pool already has), and return at once.

        Called once the state's tensors exist (after the first optimizer step, which creates the optimizer's state).
        Two sets let a save find buffers while the writer still holds the previous save's. A save that comes before
        the reservation is complete waits for a buffer being made, or makes the ones not begun itself.
        """
        plan: list[tuple[tuple[int, ...], torch.dtype, bool]] = []
        devices = set()
        for tensor in tensors:
            tensor = local_part(tensor)
            plan.append((tuple(tensor.shape), tensor.dtype, self.staging.wants_pinned(tensor)))
            if tensor.device.type == "cuda":
                devices.add(tensor.device)
        # CUDA calls of a new thread go to device 0 unless it says otherwise: on a rank of a multi-GPU host that would
        # create a context on another rank's GPU. The thread works in the context of the device the state lives on.
        device = min(devices, key=lambda d: d.index or 0) if devices else None
        thread = threading.Thread(
            target=self._make_reserved, args=(plan * sets, device), name="perdure-staging", daemon=True
        )
        with self._condition:
            if self._reserving is not None and self._reserving.is_alive():
                raise RuntimeError("a reservation of snapshot buffers is already under way")
            self._reserving = thread
        thread.start()

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """Block until the reservation under way (if any) is complete; False if `timeout` passed first."""
        thread = self._reserving
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def idle_nbytes(self) -> int:
        """Bytes of buffers free now or being made: memory a snapshot of that size does not need to allocate."""
        with self._condition:
            free = sum(b.numel() * b.element_size() for buffers in self._free.values() for b in buffers)
            coming = sum(math.prod(shape) * dtype.itemsize * n for (shape, dtype), n in self._being_made.items())
        return free + coming

    def _make_reserved(
        self, plan: list[tuple[tuple[int, ...], torch.dtype, bool]], device: torch.device | None
    ) -> None:
        wanted: Counter[BufferKind] = Counter()
        started, made = time.perf_counter(), 0
        try:
            if device is not None:
                torch.cuda.set_device(device)
            for shape, dtype, pinned in plan:
                kind = (shape, dtype)
                wanted[kind] += 1
                with self._condition:
                    if self._made[kind] >= wanted[kind]:
                        continue
                    self._made[kind] += 1
                    self._being_made[kind] += 1
                try:
                    buffer, pinned = self._make(shape, dtype, pinned, prefault=True)
                except BaseException:
                    with self._condition:
                        self._made[kind] -= 1
                        self._being_made[kind] -= 1
                        self._condition.notify_all()
                    raise
                with self._condition:  # free in the same breath as no longer being made: a waiting take finds it
                    self._being_made[kind] -= 1
                    self._free.setdefault((shape, dtype, pinned), []).append(buffer)
                    self.reserved_nbytes += buffer.numel() * buffer.element_size()
                    self._condition.notify_all()
                made += buffer.numel() * buffer.element_size()
        except Exception as error:  # out of host memory: the saves allocate what they lack themselves
            report = (logging.WARNING, f"making snapshot buffers ahead of the saves stopped ({human_bytes(made)} "
                      f"made): {type(error).__name__}: {error}")  # fmt: skip
        else:
            self.reserve_seconds = time.perf_counter() - started
            report = (logging.INFO, f"snapshot buffers ready: {human_bytes(made)} made in the background in "
                      f"{self.reserve_seconds:.2f}s")  # fmt: skip
        with self._condition:
            self._report = report

    def take_report(self) -> tuple[int, str] | None:
        """How the last reservation ended (a log level and a message), once; None while it runs or once taken. The
        training loop logs it, not the reserving thread: a log line belongs to the run whose loop it is."""
        with self._condition:
            report, self._report = self._report, None
        return report

    def _make(
        self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, prefault: bool
    ) -> tuple[torch.Tensor, bool]:
        buffer, pinned = self.staging.allocate(shape, dtype, pinned, prefault=prefault)
        if pinned:
            with self._condition:
                self._pinned.add(buffer.data_ptr())
        return buffer, pinned


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
        # One copy per tensor, however many names it has (tied weights): the copies share it as the originals do.
        self._copied: dict[tuple[Any, ...], torch.Tensor] = {}
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
            return DTensor.from_local(
                shard,
                tensor.device_mesh,
                tensor.placements,
                shape=tensor.shape,
                stride=tensor.stride(),
                run_check=False,
            )
        tensor = tensor.detach()
        view = (storage_key(tensor), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if view in self._copied:
            return self._copied[view]
        target, pinned = self._pool.take(tensor)
        self._copied[view] = target
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
    headrooms: list[int] = []
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
