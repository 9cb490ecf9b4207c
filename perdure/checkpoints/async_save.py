"""Background checkpoint writing: one write in flight, persistent saves in order, plain saves coalesced.

The loop hands over a `Snapshot` and goes on training; a writer thread waits for the snapshot's copies, then writes,
checksums, commits, publishes pointers and prunes — itself (`thread` mode), or through a spawned writer process
(`process` mode, which keeps serialization and hashing off the training process's GIL). A failure is kept and
reported by the manager at the next save; the partial directory is removed, committed checkpoints are untouched.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import pickle
import queue
import resource
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.multiprocessing as torch_mp

from perdure.checkpoints.save_errors import killed_by, save_failure
from perdure.checkpoints.save_watch import SaveWatch
from perdure.checkpoints.snapshot import BufferPool, Snapshot
from perdure.checkpoints.staging import Staging
from perdure.errors import CheckpointSaveError, CheckpointStateError
from perdure.private_api import share_storage_fd, storage_from_shared_fd
from perdure.resilience.worker_signals import preemption_signals_blocked

logger = logging.getLogger("perdure")
SentBuffers = dict[int, tuple[int, torch.Tensor]]  # id of a buffer -> (its number for the writer process, the buffer)
WRITER_PROCESS_NAME = "perdure-checkpoint-writer"
BACKGROUND = (
    "training goes on while it is written in the background, but a final or preemption save waits for it, and so "
    "does the run's exit"
)


@dataclass
class SaveJob:
    """Everything one commit needs, in plain data and CPU tensors (picklable for the writer process)."""

    name: str
    replicated: dict[str, Any]
    local: dict[str, Any]
    meta: dict[str, Any]
    is_best: bool
    texts: dict[str, str]
    persistent: bool
    protected: frozenset[str] = field(default_factory=frozenset)
    sequence: int = 0  # which save of this attempt it is: the same on every rank, so it names the staging dir
    nbytes: int = 0  # bytes of tensors in the state: what the save needs on disk, about


@dataclass
class SaveOutcome:
    """How a background save ended: `error` is None on success; `fatal` when the state can never be saved (see
    `save_errors.py`), as opposed to an I/O failure training may survive."""

    name: str
    reason: str
    seconds: float
    error: str | None = None
    fatal: bool = False


class JobCommitter(Protocol):
    """What a background saver uses of the `CheckpointManager` that owns it (checkpoints/base.py)."""

    root: Path

    def commit_job(self, job: SaveJob) -> Path: ...

    def discard_staging(self, job: SaveJob, writer_pid: int) -> None: ...


class AsyncSaver:
    """The queue between the training loop and the single background writer."""

    def __init__(
        self,
        manager: JobCommitter,
        mode: str,
        shared_memory: bool | None = None,
        device_staging: str = "auto",
        watch: SaveWatch | None = None,
    ) -> None:
        if mode not in ("thread", "process"):
            raise ValueError(f"async mode must be 'thread' or 'process', got {mode!r}")
        self.manager = manager
        self.mode = mode
        self.watch = watch
        self._condition = threading.Condition()
        self._pending: deque[tuple[SaveJob, Snapshot]] = deque()
        self._in_flight: str | None = None
        self._snapshots: list[Snapshot] = []
        self._outcomes: list[SaveOutcome] = []
        self._closed = False
        # Shared memory when another process reads the snapshot (this writer's, or a backend's own, e.g. DCP's).
        shared = mode == "process" if shared_memory is None else shared_memory
        self.pool = BufferPool(staging=Staging(shared=shared, device_staging=device_staging))
        # The writer process starts now, while training warms up, so the first save does not wait for its imports.
        self._writer = _WriterProcess(manager) if mode == "process" else None
        self._thread = threading.Thread(target=self._run, name="perdure-checkpoint-writer", daemon=True)
        self._thread.start()

    # ---- the training loop's side -------------------------------------------------------------------------------

    def make_room(self, agree: Callable[[bool], bool] | None = None) -> None:
        """Before a new snapshot: drop plain saves still waiting (newest wins) and wait while a persistent one waits.

        At most one save is written and one waits at any time, which bounds the memory snapshots take. With several
        ranks, `agree(flag)` (True on every rank only when it is True on all) makes the drop a joint decision: the
        waiting save is taken out of the writer's reach first, and put back unless every rank could take it out, so
        that the writers of all ranks write the same saves in the same order (a collective backend needs that, and
        rank 0 commits only what every rank wrote).
        """
        with self._condition:
            claimed = [item for item in self._pending if not item[0].persistent]
            self._pending = deque(item for item in self._pending if item[0].persistent)
        drop = agree(bool(claimed)) if agree is not None else bool(claimed)  # agree is collective: always called
        if drop:
            names = ", ".join(job.name for job, _ in claimed)
            logger.info("checkpoint %s superseded by a newer save before it was written", names)
            for _, snapshot in claimed:  # copied already: the loop waited for it before its last optimizer step
                snapshot.wait()
                self.pool.give_back(snapshot.buffers)
            claimed = []
        with self._condition:
            if claimed:  # another rank's writer already started it: every rank writes it
                self._pending.extendleft(reversed(claimed))
                self._condition.notify_all()
            while self._pending:
                self._condition.wait()

    def submit(self, job: SaveJob, snapshot: Snapshot) -> None:
        with self._condition:
            if self._closed:
                raise RuntimeError("the checkpoint writer is closed")
            self._pending.append((job, snapshot))
            self._snapshots.append(snapshot)
            self._condition.notify_all()

    def wait_for_snapshots(self) -> None:
        """Order the coming optimizer step after the copies of every snapshot handed over (on the device for GPU
        copies, on the host otherwise); called before the optimizer mutates parameters."""
        with self._condition:
            snapshots, self._snapshots = self._snapshots, []
        for snapshot in snapshots:
            snapshot.fence()

    def drain(self) -> None:
        """Wait until everything queued is written (or has failed)."""
        with self._condition:
            while self._pending or self._in_flight is not None:
                self._condition.wait()

    def take_outcomes(self) -> list[SaveOutcome]:
        with self._condition:
            outcomes, self._outcomes = self._outcomes, []
        return outcomes

    @property
    def in_flight(self) -> str | None:
        return self._in_flight

    def close(self) -> None:
        self.drain()
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join()
        if self._writer is not None:
            self._writer.stop()

    # ---- the writer thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._pending and not self._closed:
                    self._condition.wait()
                if not self._pending:
                    return
                job, snapshot = self._pending.popleft()
                self._in_flight = job.name
                self._condition.notify_all()
            started = time.perf_counter()
            error, fatal = None, False
            try:
                snapshot.wait()
                job.replicated, job.local = snapshot.replicated, snapshot.local
                if self.watch is not None:
                    self.watch.begin(job.name, BACKGROUND)
                if self._writer is None:
                    self.manager.commit_job(job)
                else:
                    self._writer.commit(job)
            except BaseException as failure:  # kept and reported on the loop's next save
                reported = save_failure(failure, name=job.name, root=self.manager.root, needed=job.nbytes)
                error, fatal = str(reported), isinstance(reported, CheckpointStateError)
            if self.watch is not None:
                self.watch.end(job.name)
            reason = str(job.meta.get("reason"))
            outcome = SaveOutcome(job.name, reason, time.perf_counter() - started, error, fatal)
            # The save is over: its buffers serve the next snapshot, and this thread lets go of them at once.
            self.pool.give_back(snapshot.buffers)
            del job, snapshot
            with self._condition:
                self._outcomes.append(outcome)
                self._in_flight = None
                self._condition.notify_all()


class _WriterProcess:
    """A spawned process that commits jobs; it dies with its parent so it can never publish after a kill.

    A writer that is killed (the out-of-memory killer, a signal from outside) fails the save it was writing, and the
    next save starts a new one: a run never goes on without checkpoints because its writer died once. One that exits
    with an error before it committed anything (it cannot import the training program) is not restarted: a new one
    would fail the same way, and each save says why.
    """

    def __init__(self, manager: JobCommitter) -> None:
        _raise_open_file_limit()
        self.manager = manager
        self.root = manager.root
        self.context = torch_mp.get_context("spawn")
        self.committed = 0  # jobs the current process committed
        self._start()

    def _start(self) -> None:
        self.jobs = self.context.Queue()
        self.results = self.context.Queue()
        self.buffers: SentBuffers = {}  # id of a buffer the process has -> (its number, it)
        # Descriptors of new shared buffers travel on a socket of their own, many per message (see BufferPickler).
        self.descriptors, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = self.context.Process(
            target=_writer_main,
            args=(self.manager, self.jobs, self.results, child_end, os.getpid()),
            name=WRITER_PROCESS_NAME,
            daemon=True,
        )
        # Started with the preemption signals blocked, which the child keeps: a signal to the whole job is the
        # training process's to act on (it saves through this writer); the writer ends on its queue's None, a SIGKILL
        # or its parent's death (PR_SET_PDEATHSIG), never on a SIGTERM of the parent's.
        with preemption_signals_blocked():
            self.process.start()
        child_end.close()  # the child got its own copy at the start: with it, a dead child fails the next send
        self.committed = 0

    def commit(self, job: SaveJob) -> None:
        if not self.process.is_alive():
            self._replace()
        # Pickled here, not in the queue's feeder thread, which would only print a failure and drop the job.
        sent: SentBuffers = {}
        try:
            payload, descriptors = BufferPickler.dumps(job, self.buffers, sent)
        except Exception as error:
            raise save_failure(error, name=job.name, root=self.root) from error
        self.jobs.put((len(descriptors), payload))
        try:  # after the job: the process reads them as they come, so no number of them fills the socket for good
            send_descriptors(self.descriptors, descriptors)
        except OSError as error:  # the process died (a broken pipe), or the kernel refused them
            if self.process.is_alive():  # it would wait for them forever: the next save starts another
                self.process.kill()
                self.process.join()
            raise CheckpointSaveError(
                f"handing the shared buffers of {job.name} to the checkpoint writer process failed ({error}); "
                "the next save starts another writer process"
            ) from None
        self.buffers.update(sent)  # only once the process is sure to get them, in this order
        del payload
        while True:
            try:
                name, message, fatal = self.results.get(timeout=1.0)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    assert self.process.pid is not None  # started by `_start`
                    self.manager.discard_staging(job, self.process.pid)
                    raise CheckpointSaveError(self._died(f"while writing {job.name}")) from None
        self.committed += 1
        if message is not None:
            raise (CheckpointStateError if fatal else CheckpointSaveError)(message)

    def _died(self, when: str) -> str:
        code = self.process.exitcode
        if killer := killed_by(code):
            return f"the checkpoint writer process was killed by {killer} {when}; the next save starts another"
        if self.committed == 0:
            return (
                f"the checkpoint writer process died {when} (exit {code}; its error is above). It must be able to "
                "import the training script under an `if __name__ == '__main__':` guard and the checkpoint manager's "
                "class by name; or use ckpt.async_mode=thread"
            )
        return (
            f"the checkpoint writer process died {when} (exit {code}; its error is above); the next save starts another"
        )

    def _replace(self) -> None:
        """Start a new writer in place of a dead one, unless it never got as far as committing (see the class)."""
        code = self.process.exitcode
        if code is not None and code > 0 and self.committed == 0:
            raise CheckpointSaveError(self._died("before this save"))
        logger.warning("starting a new checkpoint writer process: the last one ended (exit %s)", code)
        self._discard_queues()
        self._start()

    def _discard_queues(self) -> None:
        # Nobody reads them any more: what is still buffered for the dead process must not hold up this one's exit.
        for channel in (self.jobs, self.results):
            channel.cancel_join_thread()
            channel.close()
        self.descriptors.close()

    def stop(self) -> None:
        if not self.process.is_alive():
            self._discard_queues()
            return
        self.jobs.put(None)
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        self.descriptors.close()


def _writer_main(manager: JobCommitter, jobs: Any, results: Any, descriptors: socket.socket, parent: int) -> None:
    _die_with_parent()
    if os.getppid() != parent:
        return
    buffers: dict[int, torch.Tensor] = {}
    while True:
        message = jobs.get()
        if message is None:
            return
        count, payload = message
        received = receive_descriptors(descriptors, count)
        try:
            job = BufferUnpickler(io.BytesIO(payload), buffers, received).load()
        finally:
            for descriptor in received:  # each buffer maps a duplicate of its own
                os.close(descriptor)
        del payload
        try:
            manager.commit_job(job)
            results.put((job.name, None, False))
        except BaseException as failure:
            reported = save_failure(failure, name=job.name, root=manager.root, needed=job.nbytes)
            results.put((job.name, str(reported), isinstance(reported, CheckpointStateError)))


class BufferPickler(ForkingPickler):
    """Pickles a job for the writer process, sending each shared-memory buffer in full only once.

    The pool hands the same buffers to save after save; a buffer sent before travels as its number. A new one travels
    as its layout and the file descriptor of its shared memory, which the caller sends on a socket of its own, up to
    253 per message (`send_descriptors`). Pickled the way `torch.multiprocessing` pickles a shared tensor, each
    descriptor would be fetched by the writer process over a socket of its own, served by a thread of the training
    process under its GIL: 700 of them (the buffers of a 400M-parameter GPT's state) cost the loop 0.3 to 0.5 s on a
    GPU machine. `known` maps the id of each buffer the process has to (its number, the buffer, kept alive so its id
    is never reused); `sent` receives the buffers this job sends in full, for the caller to add to `known` once the
    job is on its way.
    """

    def __init__(self, file: Any, known: SentBuffers, sent: SentBuffers, descriptors: list[int]):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.known, self.sent, self.descriptors = known, sent, descriptors

    @classmethod
    def dumps(  # type: ignore[override]
        cls, job: Any, known: SentBuffers, sent: SentBuffers
    ) -> tuple[bytes, list[int]]:
        """The pickled job and the descriptors its new buffers need, in order (owned by the buffers: not to close)."""
        file = io.BytesIO()
        descriptors: list[int] = []
        cls(file, known, sent, descriptors).dump(job)
        return file.getvalue(), descriptors

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is not torch.Tensor:
            return None
        if id(obj) in self.known:
            return ("buffer", self.known[id(obj)][0])
        if id(obj) in self.sent:
            return ("buffer", self.sent[id(obj)][0])
        if not obj.is_shared() or obj.untyped_storage().nbytes() == 0:
            return None  # pickled in full: not a shared buffer, or an empty one (no memory, no descriptor)
        descriptor, nbytes = share_storage_fd(obj.untyped_storage())  # the descriptor it keeps; nothing is copied
        number = len(self.known) + len(self.sent)
        self.sent[id(obj)] = (number, obj)
        self.descriptors.append(descriptor)
        layout = (obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset())
        return ("new", number, len(self.descriptors) - 1, nbytes, layout)


class BufferUnpickler(pickle.Unpickler):
    """The writer process's side of `BufferPickler`: maps each new buffer from its descriptor (`received`, in the
    order they were sent; the caller closes them afterwards) and keeps it under its number."""

    def __init__(self, file: Any, buffers: dict[int, torch.Tensor], received: Sequence[int] = ()) -> None:
        super().__init__(file)
        self.buffers, self.received = buffers, received

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if pid[0] == "new":
            _, number, slot, nbytes, (dtype, shape, stride, offset) = pid
            storage = storage_from_shared_fd(self.received[slot], nbytes)  # maps a duplicate
            self.buffers[number] = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
        return self.buffers[pid[1]]


DESCRIPTORS_PER_MESSAGE = 253  # SCM_MAX_FD: the most one message may carry on Linux


def send_descriptors(channel: socket.socket, descriptors: Sequence[int]) -> None:
    """Send file descriptors on a SOCK_SEQPACKET socket, many per message; `receive_descriptors` takes them."""
    for start in range(0, len(descriptors), DESCRIPTORS_PER_MESSAGE):
        socket.send_fds(channel, [b"d"], list(descriptors[start : start + DESCRIPTORS_PER_MESSAGE]))


def receive_descriptors(channel: socket.socket, count: int) -> list[int]:
    """Receive `count` file descriptors sent by `send_descriptors` (blocks until they are all here); the caller owns
    and closes them."""
    received: list[int] = []
    while len(received) < count:
        data, descriptors, flags, _ = socket.recv_fds(channel, 1, DESCRIPTORS_PER_MESSAGE)
        received.extend(descriptors)
        if not data or flags & socket.MSG_CTRUNC:
            for descriptor in received:
                os.close(descriptor)
            raise OSError(f"the descriptors of a job's buffers were cut short ({len(received)} of {count} arrived)")
    return received


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent dies (PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    except OSError:
        pass


def _raise_open_file_limit() -> None:
    # Each shared-memory buffer keeps a file descriptor open, in this process and in the one that reads it.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
