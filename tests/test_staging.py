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
import mmap
import threading
import time

import pytest
import torch

import perdure.checkpoints.base as manager_module
from perdure.checkpoints.async_save import AsyncSaver, SaveJob
from perdure.checkpoints.base import snapshot_buffer_sets
from perdure.checkpoints.snapshot import BufferPool, Snapshot, storage_key
from perdure.checkpoints.staging import SpareDeviceMemory, Staging, private_pages
from tests.scripts.resumable import ResumableRunner, make_config


class GatedFence:
    def __init__(self, engine: GatedCopies, pairs, on_device_first: bool = False) -> None:
        self.engine, self.ordered, self.on_device_first = engine, 0, on_device_first
        # A device copy first: the copies below read clones taken now, as the CUDA engine's read its device copies.
        self.pairs = [(target, source.clone() if on_device_first else source) for target, source in pairs]
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

    def start(self, pairs, on_device_first: bool = False) -> GatedFence:
        fence = GatedFence(self, pairs, on_device_first)
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


def make_staging(device_tensors, pin=None, shared=False, device_room=0) -> tuple[Staging, GatedCopies]:
    """A staging policy whose device (the `device_tensors`) has `device_room` bytes to spare: none by default, so the
    copies go straight to the host buffers."""
    engine = GatedCopies()
    staging = Staging(shared=shared, allocate_pinned=pin or PinRecorder(), on_device=on_device(*device_tensors),
                      copies_factory=lambda: engine, device_room=lambda device: device_room)  # fmt: skip
    return staging, engine


def released_pool(device_tensors, pin) -> tuple[BufferPool, Staging, GatedCopies]:
    """A pool whose stand-in device copies complete at once."""
    staging, engine = make_staging(device_tensors, pin)
    engine.release.set()
    return BufferPool(staging=staging), staging, engine


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
    pool, staging, engine = released_pool([gpu], pin)
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


@pytest.mark.parametrize(
    ("room", "device_staging", "first"),
    [(24, "auto", True), (10**9, "auto", True), (23, "auto", False), (10**9, "off", False)],
)
def test_a_device_with_room_for_a_copy_of_the_state_gets_one_first_and_the_loop_need_not_wait(
    room, device_staging, first
):
    """24 bytes of state on the stand-in device: copied on the device first when its spare memory holds all of it
    (the copies to the host then read that copy, so training may change the tensors at once), never with `off`."""
    param, buffer = torch.arange(4.0), torch.full((2,), 7.0)
    staging, engine = make_staging([param, buffer], device_room=room)
    staging.device_staging = device_staging
    snapshot = Snapshot({"param": param, "buffer": buffer}, {}, deferred=[param], pool=BufferPool(staging=staging))
    assert [fence.on_device_first for fence in engine.fences] == [first, first]
    assert staging.staged_on_device_nbytes == (24 if first else 0)
    param.add_(1.0)  # the optimizer step and the forward, before the copies to the host ran
    buffer.add_(1.0)
    engine.release.set()
    snapshot.wait()
    if first:
        assert torch.equal(snapshot.replicated["param"], torch.arange(4.0))
        assert torch.equal(snapshot.replicated["buffer"], torch.full((2,), 7.0))


class RefusesDeviceCopies(GatedCopies):
    """A device whose memory cannot hold the device copy after all (the room estimate was wrong)."""

    def start(self, pairs, on_device_first: bool = False) -> GatedFence:
        if on_device_first:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.00 GiB (injected)")
        return super().start(pairs)


def test_a_device_copy_that_does_not_fit_falls_back_to_fenced_copies_for_good_with_one_warning(caplog):
    param = torch.arange(4.0)
    engine = RefusesDeviceCopies()
    engine.release.set()
    staging = Staging(allocate_pinned=PinRecorder(), on_device=on_device(param), copies_factory=lambda: engine,
                      device_room=lambda device: 10**9)  # fmt: skip
    pool = BufferPool(staging=staging)
    with caplog.at_level(logging.WARNING, logger="perdure"):
        for _ in range(2):
            snapshot = Snapshot({"param": param}, {}, deferred=[param], pool=pool)
            snapshot.fence()
            snapshot.wait()
            assert torch.equal(snapshot.replicated["param"], param)
            pool.give_back(snapshot.buffers)
    assert staging.device_staging == "off" and staging.staged_on_device_nbytes == 0
    assert [fence.on_device_first for fence in engine.fences] == [False, False]
    assert caplog.text.count("did not fit") == 1 and "Tried to allocate 5.00 GiB" in caplog.text


def test_the_spare_memory_of_a_gpu_keeps_the_largest_peak_it_saw(monkeypatch):
    """A user's `torch.cuda.reset_peak_memory_stats()` between two saves must not make room the next forward needs."""
    gib = 2**30
    readings = {"peak": 30 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (50 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 32 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: readings["peak"])
    room = SpareDeviceMemory()
    device = torch.device("cuda", 0)
    assert room(device) == 50 * gib + 32 * gib - 30 * gib - 8 * gib
    readings["peak"] = 2 * gib  # reset by the user's code
    assert room(device) == 44 * gib
    readings["peak"] = 40 * gib
    assert room(device) == 34 * gib


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


class GatedPin(PinRecorder):
    """Pinned allocation that blocks until `release` is set: a reservation caught in the middle."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def __call__(self, shape, dtype, shared):
        assert self.release.wait(30)
        return super().__call__(shape, dtype, shared)


def test_reserved_buffers_serve_two_snapshots_without_allocating_in_the_loop():
    gpu, cpu = torch.ones(8), torch.ones(3)
    pin = PinRecorder()
    pool, staging, engine = released_pool([gpu], pin)
    pool.reserve([gpu, cpu], sets=2)
    assert pool.wait_reserved(30)
    assert len(pin.calls) == 2 and pool.reserved_nbytes == 2 * (8 + 3) * 4 and pool.idle_nbytes() == 88
    first = Snapshot({"w": gpu, "c": cpu}, {}, deferred=[gpu], pool=pool)
    second = Snapshot({"w": gpu, "c": cpu}, {}, deferred=[gpu], pool=pool)  # the first is still being written
    assert pool.on_demand_nbytes == 0 and len(pin.calls) == 2 and pool.idle_nbytes() == 0
    assert all(buffer.shape in ((8,), (3,)) for buffer in first.buffers + second.buffers)
    third = Snapshot({"w": gpu, "c": cpu}, {}, deferred=[gpu], pool=pool)  # a third in flight: beyond the reservation
    assert pool.on_demand == {((8,), torch.float32): 1, ((3,), torch.float32): 1} and len(pin.calls) == 3
    for snapshot in (first, second, third):
        snapshot.wait()
        assert torch.equal(snapshot.replicated["w"], gpu) and torch.equal(snapshot.replicated["c"], cpu)


def test_a_reservation_counts_the_buffers_the_pool_holds():
    gpu = torch.ones(5)
    pin = PinRecorder()
    pool, staging, engine = released_pool([gpu], pin)
    snapshot = Snapshot({"w": gpu}, {}, deferred=[gpu], pool=pool)
    snapshot.wait()
    pool.give_back(snapshot.buffers)
    pool.reserve([gpu], sets=2)
    assert pool.wait_reserved(30)
    assert len(pin.calls) == 2, "one set existed already: the reservation makes only the second"
    pool.reserve([gpu], sets=2)  # again (a second attempt in the same process): nothing more
    assert pool.wait_reserved(30) and len(pin.calls) == 2


def test_a_snapshot_waits_for_a_buffer_being_made_instead_of_making_a_second():
    gpu = torch.arange(6.0)
    pin = GatedPin()
    pool, staging, engine = released_pool([gpu], pin)
    pool.reserve([gpu], sets=1)
    taken: list = []
    taker = threading.Thread(target=lambda: taken.append(pool.take(gpu)), daemon=True)
    taker.start()
    taker.join(0.3)
    assert taker.is_alive(), "the snapshot did not wait for the buffer being made"
    pin.release.set()
    taker.join(30)
    assert not taker.is_alive() and taken[0][1] is True
    assert len(pin.calls) == 1 and pool.on_demand_nbytes == 0 and pool.wait_reserved(30)


def test_a_pinning_failure_while_reserving_falls_back_to_pageable_buffers_with_one_warning(caplog):
    a, b = torch.ones(4), torch.ones(2, 2)
    pin = PinRecorder(fail_from=1)
    pool, staging, engine = released_pool([a, b], pin)
    with caplog.at_level(logging.WARNING, logger="perdure"):
        pool.reserve([a, b], sets=2)
        assert pool.wait_reserved(30)
    assert len(pin.calls) == 1 and staging.pin is False
    assert sum("pinning" in record.getMessage() for record in caplog.records) == 1
    snapshot = Snapshot({"a": a, "b": b}, {}, deferred=[a, b], pool=pool)
    snapshot.fence()
    snapshot.wait()
    assert pool.on_demand_nbytes == 0 and engine.fences == []  # pageable copies, on the snapshot's own thread
    assert torch.equal(snapshot.replicated["a"], a) and torch.equal(snapshot.replicated["b"], b)


class WaitsForItsBuffers(ResumableRunner):
    """Waits for the reservation it starts, so that which buffers the saves make is deterministic."""

    def __post_init__(self):
        super().__post_init__()
        reserve = self.checkpointing.reserve_snapshot_buffers

        def reserve_and_wait():
            reserve()
            self.pool = self.checkpoints._async_saver().pool
            assert self.pool.wait_reserved(30)

        self.checkpointing.reserve_snapshot_buffers = reserve_and_wait

    def save_checkpoint(self, reason):
        path = super().save_checkpoint(reason)
        if not hasattr(self, "made_by_first_save"):
            self.made_by_first_save = dict(self.pool.on_demand)
        return path


def test_the_runner_reserves_after_its_first_step_and_no_save_makes_a_buffer_for_the_state(tmp_path, capsys):
    runner = WaitsForItsBuffers(make_config(tmp_path, **{"steps": 9, "ckpt.interval": 3, "ckpt.async_mode": "thread"}))
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in runner.model.parameters())  # with two Adam moments
    runner.train()
    out = capsys.readouterr().out
    sets = 2 if runner.device.type == "cuda" else 1  # pinned buffers for a GPU's tensors get two sets
    assert f"making {sets} x " in out
    assert "snapshot buffers ready: " in out.split("snapshotted ckpt-s000000000003")[0], "reported by the first save"
    assert runner.pool.reserved_nbytes >= state_bytes
    state_kinds = {(tuple(p.shape), p.dtype) for p in runner.model.parameters()}
    # The first save found every buffer of the state made; a later one may make its own while the writer still
    # holds the first's (one set for pageable buffers), once.
    assert not state_kinds & set(runner.made_by_first_save), runner.made_by_first_save
    assert runner.checkpoints.last_saved == "ckpt-s000000000009"


def test_a_tensor_under_two_names_is_copied_once_and_stays_shared(tmp_path):
    weight, other = torch.arange(6.0).view(2, 3), torch.ones(3)
    snapshot = Snapshot({"model": {"embed.weight": weight, "head.weight": weight, "bias": other}},
                        {"again": weight}, deferred=[weight])  # fmt: skip
    snapshot.fence()
    snapshot.wait()
    copies = snapshot.replicated["model"]
    assert copies["embed.weight"] is copies["head.weight"] is snapshot.local["again"]
    assert torch.equal(copies["embed.weight"], weight) and len(snapshot.buffers) == 2
    assert snapshot.nbytes == (6 + 3) * 4
    # Two views of one storage are two tensors: each copied, as a sync save keeps each.
    rows = Snapshot({"first": weight[0], "second": weight[1]}, {})
    rows.wait()
    assert torch.equal(rows.replicated["first"], weight[0]) and torch.equal(rows.replicated["second"], weight[1])


class TiedRunner(WaitsForItsBuffers):
    def __init__(self, config):
        super().__init__(config)
        self.model[4].weight = self.model[2].weight  # tied, as a language model's embedding and head


def test_tied_weights_are_saved_once_shared_and_every_save_finds_its_buffers_made(tmp_path):
    """The reservation counts a tied weight once; the snapshot copied it under each name, so a save made a buffer of
    that size in the training loop (two pinned 168 MB buffers per run on the 435M GPT with a tied head, measured on an
    H200), and the checkpoint held the weight twice."""
    config = make_config(tmp_path, **{"steps": 9, "ckpt.interval": 3, "ckpt.async_mode": "thread", "depth": 2})
    runner = TiedRunner(config)
    runner.train()
    tied = (tuple(runner.model[2].weight.shape), torch.float32)
    assert tied not in runner.made_by_first_save, "the first save made a buffer for the tied weight itself"
    path = runner.run_dir.checkpoints / "ckpt-s000000000009" / "state.pth"
    model = torch.load(path, weights_only=True)["model"]
    assert model["2.weight"].untyped_storage().data_ptr() == model["4.weight"].untyped_storage().data_ptr()
    assert torch.equal(model["4.weight"], runner.model[2].weight.detach().cpu())


@pytest.mark.parametrize("ranks_on_host, reserved", [(None, True), ("4", False)])
def test_the_ranks_of_one_host_reserve_a_share_of_its_free_memory_each(tmp_path, monkeypatch, ranks_on_host, reserved):
    runner = WaitsForItsBuffers(make_config(tmp_path, **{"steps": 3, "ckpt.interval": 3, "ckpt.async_mode": "thread"}))
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in runner.model.parameters())
    # A state and a half's worth: one set of buffers, never two (pinned on a GPU would ask for two)
    monkeypatch.setattr(manager_module, "available_memory", lambda: int(1.5 * state_bytes / 0.8))
    if ranks_on_host:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks_on_host)  # then each rank's share holds under half a state
    runner.train()
    assert (runner.pool.reserved_nbytes >= state_bytes) is reserved and runner.pool.reserved_nbytes < 2 * state_bytes


def test_two_sets_of_pinned_buffers_one_of_pageable_and_fewer_when_memory_is_short():
    assert [snapshot_buffer_sets(10, room, pinned=True) for room in (25, 20, 15, 9)] == [2, 2, 1, 0]
    assert [snapshot_buffer_sets(10, room, pinned=False) for room in (25, 10, 9)] == [1, 1, 0]


def test_a_reservation_that_runs_out_of_memory_is_reported_by_the_next_save_and_the_saves_make_their_own():
    a, b = torch.ones(4), torch.ones(3)
    staging = Staging(on_device=lambda tensor: False)
    real_allocate = staging.allocate
    calls = []

    def allocate(shape, dtype, pinned, prefault=False):
        calls.append(prefault)
        if prefault and len(calls) == 2:
            raise MemoryError("injected: no host memory left")
        return real_allocate(shape, dtype, pinned, prefault)

    staging.allocate = allocate
    pool = BufferPool(staging=staging)
    pool.reserve([a, b], sets=1)
    assert pool.wait_reserved(30)
    level, message = pool.take_report()
    assert level == logging.WARNING and "stopped (16 B made): MemoryError: injected" in message
    assert pool.take_report() is None  # reported once
    snapshot = Snapshot({"a": a, "b": b}, {}, pool=pool)
    assert pool.on_demand == {((3,), torch.float32): 1} and torch.equal(snapshot.replicated["b"], b)


@pytest.mark.parametrize("shape, dtype", [((3, 5), torch.float32), ((), torch.bfloat16), ((7,), torch.bool)])
def test_a_private_buffer_to_register_has_pages_of_its_own(shape, dtype):
    buffers = [private_pages(shape, dtype) for _ in range(2)]
    for buffer in buffers:
        assert buffer.shape == shape and buffer.dtype == dtype and buffer.data_ptr() % mmap.PAGESIZE == 0
        assert not buffer.any()  # a fresh anonymous mapping reads as zeros
    buffers[0].fill_(1)  # writable, and no other buffer shares its pages
    assert buffers[0].all() and not buffers[1].any()
    assert private_pages((0, 4), dtype).shape == (0, 4)
