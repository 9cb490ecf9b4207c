"""Letting gloo's worker threads finish before the interpreter shuts down, so that a finished run exits 0.

Each gloo process group runs its collectives on worker threads (named `pt_gloo_runloop`). A worker marks a collective
complete (the caller's `wait()` returns) and only then drops its own reference to it. When the caller has already let
go of a tensor the collective used, that drop frees the tensor's Python object, which takes the GIL. If the program
reaches interpreter shutdown in between (a rank that leaves right after its last collective; a worker starved of CPU
on a busy machine), Python 3.11 ends any thread that asks for the GIL once finalization has begun with
`pthread_exit`, whose unwinding cannot pass the C++ destructor it is in: the process aborts with "terminate called
without an active exception" (SIGABRT) after every file was written, and a launcher counts the rank as failed.
Seen as `runLoop -> ~AsyncWork -> TensorImpl::decref_pyobject -> gil_scoped_acquire -> take_gil -> pthread_exit`.

`settle_gloo_workers` is registered with `atexit` when a runner is built, so it runs while the interpreter is still
whole: it waits, with the GIL released, until every gloo worker of this process is asleep and stays asleep. A pending
drop gets the GIL it needs meanwhile. It cannot wait for a collective still in flight (a worker blocked on a peer looks
asleep): every collective a runner starts is complete before `train()` returns.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

WORKER_THREAD_NAME = "pt_gloo_runloop"  # what torch's ProcessGroupGloo names its worker threads
TASKS = Path("/proc/self/task")

_registered = False


def _worker_activity() -> dict[str, tuple[str, int]] | None:
    """Each gloo worker thread's scheduler state and context switches so far; None where /proc cannot tell."""
    activity = {}
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    for tid in tids:
        try:
            if (TASKS / tid / "comm").read_text().strip() != WORKER_THREAD_NAME:
                continue
            state, switches = "?", 0
            for line in (TASKS / tid / "status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key == "State":
                    state = value.split()[0]
                elif key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                    switches += int(value)
        except (OSError, ValueError):
            continue  # the thread ended while being read
        activity[tid] = (state, switches)
    return activity


def settle_gloo_workers(timeout_s: float = 5.0, interval_s: float = 0.01) -> bool:
    """Wait until every gloo worker thread of this process is asleep (state S) with no context switch across one
    `interval_s` during which this thread held no GIL; True once settled (at once when there are none), False after
    `timeout_s`. Without /proc (not Linux), sleep one interval and return True."""
    before = _worker_activity()
    if before is None:
        time.sleep(interval_s)
        return True
    deadline = time.monotonic() + timeout_s
    while before:
        time.sleep(interval_s)  # the GIL is free: a worker waiting for it takes it now
        after = _worker_activity()
        if after is None or (after == before and all(state == "S" for state, _ in after.values())):
            return True
        if time.monotonic() > deadline:
            return False
        before = after
    return True


def settle_gloo_workers_at_exit() -> None:
    """Register `settle_gloo_workers` with `atexit`, once per process. Called when a runner is built."""
    global _registered
    if not _registered:
        atexit.register(settle_gloo_workers)
        _registered = True
