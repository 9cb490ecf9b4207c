"""Snapshot staging on the CPU (issue 9): which buffer each tensor gets (pinned / pageable / shared), that pinned
buffers are pooled and reused, that a pinning failure falls back to pageable copies with one warning, and how device
copies are ordered: buffers before the loop goes on, step-changed tensors before the optimizer step (on the device:
the loop's host thread does not wait), every copy before the writer reads.

CPU tensors stand in for GPU ones through the policy's `on_device` seam, and a gated engine stands in for the CUDA
stream (its copies run on a thread once the test releases them), so all of this runs without a GPU; the CUDA engine
itself is exercised in tests/cuda/.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from perdure.checkpoints.async_save import AsyncSaver, SaveJob
from perdure.checkpoints.snapshot import BufferPool, Snapshot, storage_key
from perdure.checkpoints.staging import Staging


class GatedFence:
    def __init__(self, engine: GatedCopies, pairs) -> None:
        self.engine, self.pairs, self.ordered = engine, list(pairs), 0
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        self.engine.release.wait(30)
        for target, source in self.pairs:
            target.copy_(source)

    def order_before_mutation(self) -> None:  # a device-side wait: recorded, the host goes on
        self.ordered += 1

    def wait(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()

    def done(self) -> bool:
        return not self.thread.is_alive()


class GatedCopies:
    """Stands in for the CUDA staging stream: copies start at once, complete once `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.fences: list[GatedFence] = []

    def start(self, pairs) -> GatedFence:
        fence = GatedFence(self, pairs)
        self.fences.append(fence)
        return fence


class PinRecorder:
    """Stands in for pinned allocation: plain buffers, every call recorded; fails from the `fail_from`-th call on."""

    def __init__(self, fail_from: int | None = None) -> None:
        self.calls: list[tuple[tuple[int, ...], torch.dtype, bool]] = []
        self.fail_from = fail_from

    def __call__(self, shape, dtype, shared):
        self.calls.append((shape, dtype, shared))
        if self.fail_from is not None and len(self.calls) >= self.fail_from:
            raise RuntimeError("cudaErrorMemoryAllocation: out of pinned memory (injected)")
        buffer = torch.empty(shape, dtype=dtype)
        return buffer.share_memory_() if shared else buffer


def on_device(*tensors: torch.Tensor):
    keys = {storage_key(tensor) for tensor in tensors}
    return lambda tensor: storage_key(tensor) in keys


def make_staging(device_tensors, pin=None, shared=False) -> tuple[Staging, GatedCopies]:
    engine = GatedCopies()
    staging = Staging(shared=shared, allocate_pinned=pin or PinRecorder(), on_device=on_device(*device_tensors),
                      copies_factory=lambda: engine)  # fmt: skip
    return staging, engine


def test_device_tensors_get_pinned_buffers_cpu_tensors_pageable_and_a_writer_process_shared_ones():
    gpu, cpu = torch.ones(3, 2), torch.ones(4)
    for shared in (False, True):
        pin = PinRecorder()
        pool = BufferPool(staging=make_staging([gpu], pin, shared=shared)[0])
        gpu_buffer, gpu_pinned = pool.take(gpu)
        cpu_buffer, cpu_pinned = pool.take(cpu)
        assert (gpu_pinned, cpu_pinned) == (True, False)
        assert pin.calls == [((3, 2), torch.float32, shared)]
        assert gpu_buffer.shape == (3, 2) and cpu_buffer.shape == (4,)
        assert cpu_buffer.is_shared() == shared == gpu_buffer.is_shared()
    # Nothing to pin in an empty tensor.
    empty = torch.ones(0)
    assert BufferPool(staging=make_staging([empty])[0]).take(empty)[1] is False


def test_pinned_buffers_are_pooled_and_reused_by_the_next_snapshot():
    gpu, cpu = torch.ones(8), torch.ones(2)
    pin = PinRecorder()
    staging, engine = make_staging([gpu], pin)
    engine.release.set()
    pool = BufferPool(staging=staging)
    first = Snapshot({"w": gpu, "c": cpu}, {}, deferred=[gpu], pool=pool)
    first.wait()
    held = first.buffers
    second = Snapshot({"w": gpu, "c": cpu}, {}, deferred=[gpu], pool=pool)  # the first is not given back yet
    assert not any(a is b for a in held for b in second.buffers) and len(pin.calls) == 2
    second.wait()
    pool.give_back(first.buffers)
    third = Snapshot({"w": gpu, "c": cpu}, {}, deferred=[gpu], pool=pool)
    assert third.replicated["w"] is first.replicated["w"] and third.replicated["c"] is first.replicated["c"]
    assert len(pin.calls) == 2  # reused: pinned memory is allocated once


def test_device_copies_are_ordered_before_the_step_without_blocking_the_host_and_awaited_by_the_writer():
    param, buffer, cpu_param = torch.arange(4.0), torch.full((2,), 7.0), torch.ones(3)
    staging, engine = make_staging([param, buffer])
    snapshot = Snapshot({"param": param, "buffer": buffer, "cpu": cpu_param}, {"rng": torch.ones(1)},
                        deferred=[param, cpu_param], pool=BufferPool(staging=staging))  # fmt: skip
    now, later = engine.fences
    assert [storage_key(source) for _, source in now.pairs] == [storage_key(buffer)]
    assert [storage_key(source) for _, source in later.pairs] == [storage_key(param)]
    assert (now.ordered, later.ordered) == (1, 0), "buffers the forward changes are fenced at once"
    assert not snapshot.done

    fenced = threading.Thread(target=snapshot.fence)
    fenced.start()
    fenced.join(5)
    assert not fenced.is_alive(), "fence() waited on the host for device copies"
    assert later.ordered == 1 and not later.done()
    snapshot.fence()  # again: nothing more to order
    assert later.ordered == 1

    waiting = threading.Thread(target=snapshot.wait)  # the writer thread
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive(), "the writer read the buffers before the device copies completed"
    engine.release.set()
    waiting.join(5)
    assert not waiting.is_alive() and snapshot.done
    for key, source in (("param", param), ("buffer", buffer), ("cpu", cpu_param)):
        assert torch.equal(snapshot.replicated[key], source)
    assert torch.equal(snapshot.local["rng"], torch.ones(1))


def test_a_pinning_failure_falls_back_to_pageable_copies_with_one_warning(caplog):
    first, second, third = torch.ones(5), torch.full((6,), 2.0), torch.full((7,), 3.0)
    pin = PinRecorder(fail_from=2)
    staging, engine = make_staging([first, second, third], pin)
    engine.release.set()
    with caplog.at_level(logging.WARNING, logger="perdure"):
        snapshot = Snapshot({"a": first, "b": second, "c": third}, {}, deferred=[first, second, third],
                            pool=BufferPool(staging=staging))  # fmt: skip
        snapshot.fence()
        snapshot.wait()
    warnings = [record.getMessage() for record in caplog.records if "pinning" in record.getMessage()]
    assert len(warnings) == 1 and "out of pinned memory (injected)" in warnings[0] and "pageable" in warnings[0]
    assert staging.pin is False and len(pin.calls) == 2  # no further attempt after the failure
    assert [len(fence.pairs) for fence in engine.fences] == [1]  # only the first went the pinned way
    for key, source in (("a", first), ("b", second), ("c", third)):
        assert torch.equal(snapshot.replicated[key], source)


class _RecordingManager:
    def __init__(self):
        self.committed = []

    def commit_job(self, job):
        self.committed.append({key: value.clone() for key, value in job.replicated.items()})


def test_the_saver_fences_snapshots_before_the_step_and_writes_only_complete_copies():
    param = torch.arange(3.0)
    staging, engine = make_staging([param])
    manager = _RecordingManager()
    saver = AsyncSaver(manager, "thread")
    saver.pool = BufferPool(staging=staging)
    snapshot = Snapshot({"param": param}, {}, deferred=[param], pool=saver.pool)
    saver.submit(SaveJob("a", {}, {}, {"reason": "interval"}, is_best=False, texts={}, persistent=False), snapshot)
    started = time.monotonic()
    saver.wait_for_snapshots()  # the loop, before its optimizer step
    assert time.monotonic() - started < 5 and engine.fences[0].ordered == 1
    assert manager.committed == []  # the writer waits for the copies
    engine.release.set()
    saver.close()
    assert len(manager.committed) == 1 and torch.equal(manager.committed[0]["param"], param)


@pytest.mark.parametrize("shared", [False, True])
def test_the_default_policy_pins_nothing_on_cpu_tensors(shared):
    pool = BufferPool(shared_memory=shared)
    buffer, pinned = pool.take(torch.ones(4))
    assert pinned is False and buffer.is_shared() == shared and pool.staging.pin_failure is None
