"""How snapshot buffers reach a writer process (`ckpt.async_mode=process`): shared memory made without holding the
GIL, outside /dev/shm, and each buffer's file descriptor handed over once, many per message, never through
multiprocessing's resource sharer (whose thread serves one descriptor per request under the training process's GIL).
"""

from __future__ import annotations

import errno
import io
import logging
import multiprocessing.resource_sharer
import os
import socket

import pytest
import torch

from perdure.checkpoints import async_save
from perdure.checkpoints.async_save import (
    DESCRIPTORS_PER_MESSAGE,
    BufferPickler,
    BufferUnpickler,
    receive_descriptors,
    send_descriptors,
)
from perdure.checkpoints.commit import read_pointer
from perdure.checkpoints.snapshot import BufferPool
from perdure.checkpoints.staging import Staging, shared_pages
from tests.runs import assert_same_weights
from tests.scripts.resumable import ResumableRunner, make_config


class Channel:
    """Both ends of a writer process's descriptor socket, in this process; counts the messages sent."""

    def __init__(self) -> None:
        self.sender, self.receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.known, self.buffers, self.messages = {}, {}, 0

    def send(self, job):
        sent = {}
        payload, descriptors = BufferPickler.dumps(job, self.known, sent)
        send_descriptors(self.sender, descriptors)
        self.messages += -(-len(descriptors) // DESCRIPTORS_PER_MESSAGE)
        self.known.update(sent)
        received = receive_descriptors(self.receiver, len(descriptors))
        try:
            return len(sent), BufferUnpickler(io.BytesIO(payload), self.buffers, received).load()
        finally:
            for descriptor in received:
                os.close(descriptor)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def channel():
    channel = Channel()
    yield channel
    channel.close()


def test_the_writer_process_gets_each_shared_buffer_in_full_once_then_by_number(channel):
    shared = [torch.full((4,), float(i)).share_memory_() for i in range(3)]
    count, first = channel.send({"a": shared, "again": shared[0], "step": 7})
    assert count == 3 and first["again"] is first["a"][0]
    for buffer in shared:
        buffer.add_(10)  # the next save's copies, into the same buffers
    count, second = channel.send({"a": shared, "again": shared[0], "step": 8})
    assert count == 0, "a buffer the writer has was sent again"
    assert all(b is a for a, b in zip(first["a"], second["a"])) and second["again"] is second["a"][0]
    assert [float(b[0]) for b in second["a"]] == [10.0, 11.0, 12.0]  # the very memory, not a copy
    assert second["step"] == 8


def test_the_descriptors_of_many_buffers_travel_in_few_messages_and_map_the_very_memory(channel):
    kinds = [((3, 5), torch.float32), ((), torch.bfloat16), ((7,), torch.bool), ((0, 4), torch.float32)]
    buffers = [shared_pages(*kinds[i % len(kinds)]) for i in range(800)]
    count, received = channel.send({"state": buffers})
    assert count == 600 and channel.messages == 3  # 253 a message; the 200 empty buffers travel as they are
    for mine, theirs in zip(buffers, received["state"]):
        assert (theirs.shape, theirs.dtype, theirs.stride()) == (mine.shape, mine.dtype, mine.stride())
        assert theirs.untyped_storage().size() == mine.untyped_storage().size()  # torch.save writes this, no more
    buffers[0].fill_(2.5)
    buffers[2].fill_(True)
    assert torch.equal(received["state"][0], torch.full((3, 5), 2.5)) and received["state"][2].all()
    # A view of a shared buffer keeps its place in it.
    count, again = channel.send({"row": buffers[4][1], "whole": buffers[4]})
    assert count == 1 and torch.equal(again["row"], buffers[4][1]) and again["row"].storage_offset() == 5


def test_descriptors_cut_short_are_an_error_and_closed(channel):
    buffers = [shared_pages((4,), torch.float32) for _ in range(2)]
    descriptors = [buffer.untyped_storage()._share_fd_cpu_()[0] for buffer in buffers]
    send_descriptors(channel.sender, descriptors)
    channel.sender.close()  # the sending process died before the rest
    open_before = snapshot_memfds()
    with pytest.raises(OSError, match="cut short .2 of 5 arrived"):
        receive_descriptors(channel.receiver, 5)
    assert snapshot_memfds() <= open_before, "the two that arrived are still open"


def snapshot_memfds() -> int:
    """Descriptors of this process open on snapshot buffers (other tests' threads may open other files meanwhile)."""
    count = 0
    for entry in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{entry}").startswith("/memfd:perdure-snapshot")
        except OSError:
            pass
    return count


def test_shared_buffers_are_made_without_share_memory_and_outside_dev_shm(monkeypatch):
    """`share_memory_()` fills the new file holding the GIL (about 60 ms per 256 MB here): buffers made ahead of the
    saves on a background thread stalled the training loop for seconds on a GPU machine. And /dev/shm may be a
    64 MB tmpfs in a container."""

    def refuse(self):
        raise AssertionError("share_memory_ holds the GIL while it copies")

    monkeypatch.setattr(torch.Tensor, "share_memory_", refuse)
    monkeypatch.setattr(torch.UntypedStorage, "share_memory_", refuse)
    pool = BufferPool(staging=Staging(shared=True))
    state = [torch.randn(64, 32), torch.zeros((), dtype=torch.int64), torch.ones(3, dtype=torch.bfloat16)]
    pool.reserve(state, sets=1)
    assert pool.wait_reserved(30) and pool.take_report()[0] == logging.INFO  # made, no failure
    for tensor in state:
        buffer, pinned = pool.take(tensor)
        assert buffer.is_shared() and not pinned and buffer.shape == tensor.shape and buffer.dtype == tensor.dtype
        descriptor, nbytes = buffer.untyped_storage()._share_fd_cpu_()
        assert os.readlink(f"/proc/self/fd/{descriptor}").startswith("/memfd:perdure-snapshot")
        assert nbytes == tensor.numel() * tensor.element_size()


class ManyTensors(ResumableRunner):
    """About 1,200 tensors in its state (the parameters, AdamW's two moments and step counts): five messages."""


def test_a_process_mode_run_hands_its_buffers_over_without_the_resource_sharer(tmp_path, monkeypatch):
    served = []
    original = multiprocessing.resource_sharer.DupFd.__init__

    def count(self, fd):
        served.append(fd)
        original(self, fd)

    monkeypatch.setattr(multiprocessing.resource_sharer.DupFd, "__init__", count)
    config = make_config(tmp_path, **{"steps": 6, "ckpt.interval": 3, "ckpt.async_mode": "process", "depth": 150})
    config.width = 8
    runner = ManyTensors(config)
    runner.train()
    assert served == [], f"{len(served)} descriptors went through multiprocessing's resource sharer"
    state = torch.load(runner.run_dir.checkpoints / "ckpt-s000000000006" / "state.pth", weights_only=True)
    live = runner.model.state_dict()
    assert len(live) == 2 * 152
    assert_same_weights(live, state["model"])  # compared on the CPU: the live model may be on a GPU
    assert len(state["optimizer"]["state"]) == 2 * 152


def test_more_descriptors_than_the_socket_holds_reach_the_writer_process(tmp_path, monkeypatch):
    """The job goes first and its descriptors after it, which the writer process reads as they come: sent first,
    more than the socket holds (about 70,000 by default, 6 messages of 253 at its smallest, here) blocked the
    training process's writer thread for good, with the writer process still waiting for the job."""
    original = socket.socketpair

    def small(*args):
        pair = original(*args)
        for end in pair:
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1)  # the kernel's smallest
        return pair

    monkeypatch.setattr(async_save.socket, "socketpair", small)
    config = make_config(tmp_path, **{"steps": 3, "ckpt.interval": 3, "ckpt.async_mode": "process", "depth": 300})
    config.width = 4
    runner = ManyTensors(config)
    runner.train()  # with the descriptors first: hangs here (the test's timeout fails it)
    state = torch.load(runner.run_dir.checkpoints / "ckpt-s000000000003" / "state.pth", weights_only=True)
    assert len(state["optimizer"]["state"]) == 2 * 302
    assert_same_weights(runner.model.state_dict(), state["model"])


def test_descriptors_the_kernel_refuses_fail_that_save_and_the_next_one_starts_a_new_writer(
    tmp_path, monkeypatch, capsys
):
    """A writer process that got a job but none of its descriptors would wait for them forever: it is killed, the
    save fails saying why, and the next save starts another writer process and commits."""
    real, calls = async_save.send_descriptors, []

    def refuse_once(channel, descriptors):
        calls.append(len(descriptors))
        if len(calls) == 1:
            raise OSError(errno.ETOOMANYREFS, "Too many references: cannot splice (injected)")
        real(channel, descriptors)

    monkeypatch.setattr(async_save, "send_descriptors", refuse_once)
    config = make_config(tmp_path, **{"steps": 6, "ckpt.interval": 3, "ckpt.async_mode": "process"})
    runner = ResumableRunner(config)
    runner.train()
    out = capsys.readouterr().out
    assert "handing the shared buffers of ckpt-s000000000003 to the checkpoint writer process failed" in out
    assert "Too many references" in out and "starting a new checkpoint writer process" in out
    assert calls[0] == calls[1] > 0, "the new process got every buffer again"
    assert read_pointer(runner.run_dir.checkpoints, "latest") == "ckpt-s000000000006"
    assert not (runner.run_dir.checkpoints / "ckpt-s000000000003").exists()
