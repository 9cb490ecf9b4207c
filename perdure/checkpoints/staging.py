"""Staging: which host buffer a snapshot copies a tensor into, and how a GPU tensor gets there without a stall.

A GPU tensor is copied into a pinned (page-locked) host buffer with `non_blocking=True`, on a dedicated CUDA stream
that first waits for the training stream; an event recorded behind the copies is what the training stream waits on
(on the device: the host goes on) before anything changes the tensor. Pinned memory is scarce and slow to allocate, so
the buffers are pooled, made ahead of the first save on a background thread and reused by every snapshot after it
(`BufferPool` in snapshot.py). A buffer is pinned by registering memory of its own pages (an anonymous mapping, or
shared memory) with CUDA (`cudaHostRegister`) after its pages were faulted in, not by `cudaHostAlloc`: PyTorch's own
host allocator offers registration because of the long lock waits of `cudaHostAlloc` (pytorch#108488), and it rounds
each block up to a power of two. When pinning fails, the policy falls back to pageable buffers, copied by the
snapshot's background thread, and says so once. For a writer process the buffers are shared memory, so that process
reads the very bytes the copies wrote, with no copy in between. CPU tensors always get pageable (or shared) buffers.

The copy to the host takes time (5 GB at about 25 GB/s: 0.2 s), and the next optimizer step must wait for it. When the
GPU has room to spare (`device_staging = "auto"`: the training's peak allocation so far, plus a copy of the state,
plus a tenth of the device's memory, fit in what this process can have), the snapshot first copies the state on the
device (a device-to-device copy on the training stream: milliseconds), and the staging stream copies that to the
host. The loop then waits for nothing; the device copy goes back to PyTorch's allocator once it is on the host.

Everything CUDA-specific sits behind seams a test can replace: `allocate_pinned` (which may fail), `copies` (the engine
that starts device-to-host copies and returns a fence) and `device_room` (the spare memory of a device).
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from perdure.private_api import storage_from_shared_fd

logger = logging.getLogger("perdure")

CopyPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (host buffer, source tensor)


class CopyFence(Protocol):
    """Copies in flight, started by a `DeviceCopies` engine."""

    def order_before_mutation(self) -> None:
        """Make whatever the training loop runs from now on wait for the copies (on the device where it can)."""

    def wait(self) -> None:
        """Block this thread until the copies are complete; the host buffers may be read afterwards."""

    def done(self) -> bool:
        """Whether the copies are complete (never blocks)."""


class DeviceCopies(Protocol):
    def start(self, pairs: CopyPairs, on_device_first: bool) -> CopyFence:
        """Start copying each source (all on one device) into its pinned host buffer, after the work the training
        stream has queued so far; returns at once. `on_device_first`: copy the sources on the device first, in the
        training stream's order, so the fence needs no ordering (`order_before_mutation` does nothing)."""


def allocate_pinned(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """A page-locked host buffer (in shared memory when `shared`): ordinary memory whose pages are faulted in first,
    then registered with CUDA for every context (cudaHostRegisterPortable, as DCP's own staging registers it).

    Raises when CUDA cannot pin it (no CUDA, the pinned-memory limit reached, ...).
    """
    # Zeroed: every page faulted in now, not under CUDA's lock.
    buffer = (shared_pages(shape, dtype) if shared else private_pages(shape, dtype)).zero_()
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 1))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of a host buffer of {list(shape)} failed with cudaError {error}")
    weakref.finalize(buffer, _unpin, buffer.data_ptr())
    return buffer


def private_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in an anonymous memory mapping of its own. Registration pins whole pages: a buffer from the heap may
    share a page with another allocation (another buffer registered already: cudaErrorHostMemoryAlreadyRegistered);
    a mapping of its own starts on a page and shares none. The tensor keeps the mapping alive."""
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    pages = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def shared_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor in a shared-memory file of its own (a memfd), which a writer process maps by its descriptor.

    `Tensor.share_memory_()` would do, but it holds the GIL while it fills the file: about 60 ms per 256 MB here, in
    which the training loop cannot run (a reservation of 10 GB on a background thread: seconds of stalled steps).
    Here the file's pages are allocated by `posix_fallocate`, which lets go of the GIL (and fails with an error, where
    pages touched later would kill the process with SIGBUS), and mapped without a copy. Not on /dev/shm either, whose
    size a container may cap at 64 MB. Falls back to `share_memory_()` where memfd does not exist (not Linux).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not hasattr(os, "memfd_create"):
        return torch.empty(shape, dtype=dtype).share_memory_()
    fd = os.memfd_create("perdure-snapshot", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        storage = storage_from_shared_fd(fd, nbytes)  # maps a duplicate of the descriptor
    finally:
        os.close(fd)
    # torch's stubs require `stride`, which defaults to the contiguous one.
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]


def _unpin(data_ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(data_ptr)
    except Exception:  # at interpreter exit CUDA may be gone already; the pages go with the process
        pass


class SpareDeviceMemory:
    """Bytes of a device a copy of the state may take while training goes on: what this process can have (the
    device's free memory plus what PyTorch's allocator holds) less the training's peak allocation (the next forward and
    backward need it again while the copy lives) and a tenth of the device (fragmentation, other allocations).

    The peak is the largest this object has read: a `torch.cuda.reset_peak_memory_stats()` in the user's code between
    two saves does not shrink it. Conservative: a peak reached while an earlier copy lived counts that copy too."""

    def __init__(self) -> None:
        self._peaks: dict[torch.device, int] = {}

    def __call__(self, device: torch.device) -> int:
        free, total = torch.cuda.mem_get_info(device)
        peak = self._peaks[device] = max(self._peaks.get(device, 0), torch.cuda.max_memory_allocated(device))
        return max(0, free + torch.cuda.memory_reserved(device) - peak - total // 10)


class CudaFence:
    """An event recorded behind copies on the staging stream; holds the sources until the copies are seen complete,
    so the caching allocator cannot hand their memory to the loop while the staging stream still reads it.
    `ordered`: the copies read a device copy made in the training stream's order, nothing needs to wait for them."""

    def __init__(
        self, event: torch.cuda.Event, device: torch.device, sources: list[torch.Tensor], ordered: bool = False
    ) -> None:
        self.event, self.device, self._sources, self.ordered = event, device, sources, ordered

    def order_before_mutation(self) -> None:
        if not self.ordered:
            torch.cuda.current_stream(self.device).wait_event(self.event)

    def wait(self) -> None:
        with torch.cuda.device(self.device):  # the writer thread's CUDA calls: this device's context, not device 0's
            self.event.synchronize()
        self._sources = []

    def done(self) -> bool:
        with torch.cuda.device(self.device):
            complete = self.event.query()
        if complete:
            self._sources = []
        return complete


class CudaCopies:
    """Device-to-host copies on one dedicated stream per device, each batch behind the training stream's queued work."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def start(self, pairs: CopyPairs, on_device_first: bool = False) -> CudaFence:
        device = pairs[0][1].device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        # A device copy is made on the training stream, so it holds the values of this instant whatever runs next.
        sources = [source.clone() if on_device_first else source for _, source in pairs]
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for (target, _), source in zip(pairs, sources):
                target.copy_(source, non_blocking=True)
                if on_device_first:  # freed by us now; the allocator reuses it once the staging stream has read it
                    source.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return CudaFence(event, device, [] if on_device_first else sources, ordered=on_device_first)


def is_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


@dataclass
class Staging:
    """The policy of one buffer pool: shared memory or not, pinned buffers for device tensors or not, and how.

    `shared`: buffers live in shared memory (a writer process reads them without another copy). `pin`: device
    tensors get pinned buffers and asynchronous copies; it turns False for good after the first failure to pin.
    """

    shared: bool = False
    pin: bool = True
    device_staging: str = "auto"  # "auto": a device copy first where the device has room; "off": never
    allocate_pinned: Callable[[tuple[int, ...], torch.dtype, bool], torch.Tensor] = allocate_pinned
    on_device: Callable[[torch.Tensor], bool] = is_cuda
    copies_factory: Callable[[], DeviceCopies] = CudaCopies
    device_room: Callable[[torch.device], int] = field(default_factory=SpareDeviceMemory)
    pin_failure: str | None = None
    staged_on_device_nbytes: int = 0  # bytes copied on a device first, over all snapshots (what a benchmark reports)
    _copies: DeviceCopies | None = field(default=None, repr=False)

    def wants_pinned(self, source: torch.Tensor) -> bool:
        """Whether a buffer for `source` should be pinned: a device tensor with data, while pinning works."""
        return self.pin and source.numel() > 0 and self.on_device(source)

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool, prefault: bool = False
    ) -> tuple[torch.Tensor, bool]:
        """A new buffer and whether it is pinned: pinned when asked and possible, else pageable (shared if so set).

        `prefault`: write every page of a pageable buffer now (a background thread making buffers ahead of a save),
        so the snapshot's copy into it does not pay a page fault per 4 KB. Pinned and shared buffers always are.
        """
        if pinned and self.pin:
            try:
                return self.allocate_pinned(shape, dtype, self.shared), True
            except Exception as error:  # out of pinned memory, a CUDA error, ...
                self.pin = False
                self.pin_failure = f"{type(error).__name__}: {error}"
                logger.warning(
                    "pinning a %s host buffer of %s failed (%s): snapshots of GPU tensors use pageable buffers from "
                    "now on, copied by a background thread, so an async save stalls training longer",
                    "shared" if self.shared else "private",
                    list(shape),
                    self.pin_failure,
                )
        buffer = shared_pages(shape, dtype) if self.shared else torch.empty(shape, dtype=dtype, device="cpu")
        return (buffer.zero_() if prefault else buffer), False

    def start_copies(self, now: CopyPairs, later: CopyPairs) -> tuple[list[CopyFence], list[CopyFence]]:
        """Start the copies into pinned buffers, per device: `now` first, ordered at once before anything the loop
        runs next (buffers the forward changes), then `later` (tensors only the optimizer step changes), whose fences
        the caller orders before that step. A device with room for a copy of both gets one first (see the module's
        docstring), and its fences order nothing. Returns (the `now` fences, the `later` fences)."""
        if not now and not later:
            return [], []
        if self._copies is None:
            self._copies = self.copies_factory()
        first = self._on_device_first([*now, *later])
        fences: tuple[list[CopyFence], list[CopyFence]] = ([], [])
        for group, fenced in zip((now, later), fences):
            by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
            for target, source in group:
                by_device.setdefault(source.device, []).append((target, source))
            for device, pairs in by_device.items():
                fenced.append(self._start(self._copies, pairs, device in first))
        for fence in fences[0]:
            fence.order_before_mutation()
        return fences

    def _start(self, copies: DeviceCopies, pairs: CopyPairs, on_device_first: bool) -> CopyFence:
        """Start one device's copies; a device copy that does not fit after all is given up, for good, with a word."""
        if on_device_first and self.device_staging == "auto":
            try:
                fence = copies.start(pairs, True)
            except torch.OutOfMemoryError as error:
                self.device_staging = "off"
                logger.warning(
                    "a copy of the state on %s for an async snapshot did not fit (%s): snapshots copy straight to "
                    "pinned host buffers from now on, and the optimizer step after a save waits for that copy",
                    pairs[0][1].device,
                    str(error).splitlines()[0],
                )
            else:
                self.staged_on_device_nbytes += sum(source.numel() * source.element_size() for _, source in pairs)
                return fence
        return copies.start(pairs, False)

    def _on_device_first(self, pairs: CopyPairs) -> set[torch.device]:
        """The devices whose sources get a device copy first: each whose spare memory holds a copy of all of them."""
        if self.device_staging != "auto":
            return set()
        nbytes: dict[torch.device, int] = {}
        for _, source in pairs:
            nbytes[source.device] = nbytes.get(source.device, 0) + source.numel() * source.element_size()
        return {device for device, size in nbytes.items() if size <= self.device_room(device)}
