"""A gloo worker thread starved of CPU still holds the last reference to a collective's tensor (see
perdure/distributed/gloo_exit.py). Prints one JSON line: whether that tensor was freed before and after settling,
and on which thread.

The worker is made to starve for real: it shares this process's one CPU under SCHED_IDLE (it runs only when nothing
else wants the CPU), so it completes and releases the collective only once this thread sleeps."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref

os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread, and the threads it starts, on one CPU

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from perdure.distributed.gloo_exit import (  # noqa: E402
    WORKER_THREAD_NAME,
    settle_gloo_workers,
    settle_gloo_workers_at_exit,
)

MODE = sys.argv[1]  # settle: now; at-exit: as a runner registers it; none: never


def gloo_workers() -> list[int]:
    """The gloo worker threads' ids, once they have their name (a thread names itself when it starts)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        tids = [int(tid) for tid in os.listdir("/proc/self/task")
                if open(f"/proc/self/task/{tid}/comm").read().strip() == WORKER_THREAD_NAME]  # fmt: skip
        if tids:
            return tids
        time.sleep(0.01)
    raise RuntimeError(f"no {WORKER_THREAD_NAME} thread")


def record_thread(into: list[str]) -> None:
    into.append(threading.current_thread().name)


def main() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if MODE == "at-exit":
        settle_gloo_workers_at_exit()
    for tid in gloo_workers():
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    # Until the worker is starved at the moment the tensor is let go (it may get the CPU first): then it alone holds
    # the tensor, and frees it whenever it next runs.
    for _ in range(50):
        freed_on: list[str] = []
        tensor = torch.ones(4)
        weakref.finalize(tensor, record_thread, freed_on)
        dist.all_reduce(tensor, async_op=True)  # neither the tensor nor the work is kept
        del tensor
        if not freed_on:
            break
    else:
        raise RuntimeError("the gloo worker was never starved")
    settled = settle_gloo_workers() if MODE == "settle" else None
    print(json.dumps({"settled": settled, "freed_on": freed_on}), flush=True)


if __name__ == "__main__":
    main()
