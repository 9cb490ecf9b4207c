"""A replica group stopped from outside: one clear line, the attempt recorded `killed`, exit status 94.

torchft's lighthouse dashboard stops a group with `POST /replica/<id>/kill`: the lighthouse asks the group's manager
server (in the group's rank 0) to end, and torchft's Rust handler calls C `exit(1)` on one of its server threads.
No Python exception, no `finally`: while the process tears torch's C++ state down, the training thread fails with a
raw traceback (`RuntimeError: unknown parameter type`) and nothing records why the group ended.

`KillWatch` sees that exit. Two C exit handlers are registered with glibc's `__cxa_atexit` (plain libc functions,
no Python in them): the first to run posts semaphore `began`, the next waits on semaphore `release`. A Python
thread waits on `began`. When native code calls `exit()` while the watch is armed, the exiting thread is parked in
the second handler before torch's own exit handlers (registered earlier, run later) have touched anything; the
Python thread wakes, calls `on_kill` (which says so and records the attempt; given `ACT_SECONDS`) and ends the
process with `os._exit(KILLED_EXIT_CODE)`. `disarm()` (when the runner closes, and as a Python `atexit` handler,
which runs before the interpreter finalizes) posts `release` and wakes the thread to end: the C handlers that run at
a normal exit then return at once. C exit handlers cannot be removed: each registered pair leaves two that do nothing
after `disarm()`; each watch 64 bytes of semaphores.

Exit handlers run last registered first, and C++ registers the destructor of a function-local static when the static
is first built: one that torch, gloo or torchft first builds after `arm()` (the manager's start, the first
all-reduce) is destroyed at `exit()` *before* the watch parks the exiting thread, while the training thread may still
use it (a group killed from the dashboard then died by SIGSEGV in `torch.accelerator`, exit -11, nothing recorded).
`rearm()` registers the pair again, on the same semaphores, so that it runs before those: the runner calls it once its
manager is built and at its first two commits (after the first all-reduce, and after a whole step). `disarm()` posts
`release` once per pair.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import sys
import threading
from collections.abc import Callable

from perdure.resilience.hang_watch import ACT_SECONDS, _bounded

logger = logging.getLogger("perdure")

KILLED_EXIT_CODE = 94  # stopped from outside on purpose (torchft's kill): a relaunch is the operator's decision
_SEM_BYTES = 32  # sizeof(sem_t) on 64-bit glibc


def killed_line(replica_id: int, lighthouse: str, torchft_id: str) -> str:
    """What a group stopped from the lighthouse says (and records as the reason of its attempt)."""
    return (
        f"replica group {replica_id} was stopped from outside: its torchft manager received a kill request and ended "
        f"the process (the dashboard of the lighthouse at {lighthouse} sends one on POST /replica/{torchft_id}:<uuid>"
        f"/kill, without authentication). The attempt is recorded `killed`; exit status {KILLED_EXIT_CODE}. The steps "
        "since the last checkpoint of this group are lost; relaunch it with the same command to resume or heal. "
        "Keep the lighthouse on loopback (its default) so that only this machine can stop groups (docs/security.md)"
    )


class KillWatch:
    """Armed in the process that runs a group's torchft manager server, from `arm()` until `disarm()`."""

    def __init__(self, on_kill: Callable[[], None]) -> None:
        self._on_kill = on_kill
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._began = self._release = 0
        self._pairs = 0  # registered pairs of C exit handlers, each waiting once on `release` at a normal exit
        self._disarmed = threading.Event()
        self._thread: threading.Thread | None = None

    def _semaphore(self) -> int:
        """A process-private semaphore at 0, in memory never freed (the C exit handlers use it after Python ends)."""
        libc = self._libc
        libc.malloc.restype = ctypes.c_void_p
        address = libc.malloc(ctypes.c_size_t(_SEM_BYTES))
        if not address or libc.sem_init(ctypes.c_void_p(address), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "sem_init failed for the kill watch")
        return address

    def arm(self) -> KillWatch:
        self._began, self._release = self._semaphore(), self._semaphore()
        self._register()
        atexit.register(self.disarm)
        os.register_at_fork(after_in_child=self._forked)  # a forked child (a data worker) has no watch thread
        self._thread = threading.Thread(target=self._watch, name="perdure-ft-kill-watch", daemon=True)
        self._thread.start()
        return self

    def rearm(self) -> None:
        """Register the watch's exit handlers again, ahead of every handler registered so far (module docstring).
        Call it after code that may first build C++ statics has run; each call leaves two more C handlers."""
        if self._thread is not None and not self._disarmed.is_set():
            self._register()

    def _register(self) -> None:
        libc = self._libc
        handler = ctypes.cast(libc.sem_post, ctypes.c_void_p)
        wait = ctypes.cast(libc.sem_wait, ctypes.c_void_p)
        # Run in reverse order of registration: `sem_post(began)` first, then `sem_wait(release)`.
        for function, argument in ((wait, self._release), (handler, self._began)):
            if libc["__cxa_atexit"](function, ctypes.c_void_p(argument), None) != 0:
                raise OSError(ctypes.get_errno(), "__cxa_atexit failed for the kill watch")
            if function is wait:  # registered: a normal exit runs it, so `disarm` must post `release` for it
                self._pairs += 1

    def _release_every_pair(self) -> None:
        for _ in range(self._pairs):
            self._libc.sem_post(ctypes.c_void_p(self._release))

    def disarm(self) -> None:
        """The process ends (or the runner closes) through Python: the watch stands down. Idempotent."""
        if self._thread is None or self._disarmed.is_set():
            return
        self._disarmed.set()
        self._release_every_pair()
        self._libc.sem_post(ctypes.c_void_p(self._began))
        self._thread.join(timeout=5)
        atexit.unregister(self.disarm)

    def _forked(self) -> None:
        """In a child forked through Python: the inherited C handlers must not park its exit (nothing would wake
        them); its copy of `release` is posted, once per pair."""
        if not self._disarmed.is_set():
            self._disarmed.set()
            self._release_every_pair()
            atexit.unregister(self.disarm)

    def _watch(self) -> None:
        while self._libc.sem_wait(ctypes.c_void_p(self._began)) != 0:  # EINTR: wait again
            pass
        if self._disarmed.is_set():
            return
        _bounded(self._on_kill, ACT_SECONDS)  # a hung filesystem must not keep the process alive, half exited
        for handler in logging.getLogger("perdure").handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(KILLED_EXIT_CODE)
