"""What `ckpt.async_mode=process` costs the training loop before its first saves: making the shared buffers and
handing them to the writer process, against how perdure did both until a87d01c, in the same run.

    python benchmarks/writer_handover.py [--gib 2] [--buffers 1200] [--rounds 3]

The training loop stands in as a small MLP's steps (forward, backward, AdamW) on the main thread, about a millisecond
each, so most of a step is Python that needs the GIL. While it runs, a background thread of the same process:
- `reserve`: makes `--gib` GiB of shared buffers (64 of them), as the pool does ahead of the first save:
  `torch.empty(...).share_memory_()` (before) against `shared_pages(...).zero_()` (now: a memfd whose pages
  `posix_fallocate` allocates, then written without the GIL);
- `handover`: sends `--buffers` small shared buffers to a spawned process, as the first save of each buffer set
  does: pickled by `torch.multiprocessing`'s reductions, each descriptor then fetched by that process from
  multiprocessing's resource sharer (before), against `BufferPickler` + `send_descriptors`, 253 per message (now).
Reported per case: the loop's time lost while the background work ran (the window, less the steps it completed at
the loop's own median step time measured alone in the same round), and how long the background work took.
Target: each `now` loses at most a quarter of what `before` loses.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

import torch
from _common import format_table, format_targets, median, setup_threads, spread, target, write_results
from torch import nn

from perdure.checkpoints.async_save import BufferPickler, BufferUnpickler, receive_descriptors, send_descriptors
from perdure.checkpoints.staging import shared_pages


class Loop:
    """The training loop's stand-in: steps of a small MLP, each timed."""

    def __init__(self) -> None:
        self.model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.inputs, self.targets = torch.randn(64, 256), torch.randint(0, 10, (64,))

    def step(self) -> None:
        self.optimizer.zero_grad()
        nn.functional.cross_entropy(self.model(self.inputs), self.targets).backward()
        self.optimizer.step()

    def median_step(self, steps: int = 300) -> float:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - started)
        return median(times)

    def lost_while(self, work: Callable[[], None], step_s: float) -> tuple[float, float]:
        """Run `work` on a thread while stepping; (the loop's time lost in that window, the work's own seconds)."""
        took: list[float] = []

        def timed() -> None:
            started = time.perf_counter()
            work()
            took.append(time.perf_counter() - started)

        thread = threading.Thread(target=timed)
        steps, started = 0, time.perf_counter()
        thread.start()
        while thread.is_alive():
            self.step()
            steps += 1
        window = time.perf_counter() - started
        thread.join()
        return max(0.0, window - steps * step_s), took[0]


def reserve(how: str, gib: float, kept: list[torch.Tensor]) -> Callable[[], None]:
    count = 64
    shape = (int(gib * 2**30) // 4 // count,)

    def work() -> None:
        for _ in range(count):
            if how == "before":
                kept.append(torch.empty(shape).share_memory_())
            else:
                kept.append(shared_pages(shape, torch.float32).zero_())

    return work


def _receiver(jobs, done, descriptors) -> None:
    buffers: dict[int, torch.Tensor] = {}
    while (message := jobs.get()) is not None:
        how, count, payload = message
        if how == "before":
            received = pickle.loads(payload)  # fetches every descriptor from the sender's resource sharer
        else:
            fds = receive_descriptors(descriptors, count)
            received = BufferUnpickler(io.BytesIO(payload), buffers, fds).load()
            for fd in fds:
                os.close(fd)
        done.put(len(received))
        buffers.clear()


def handover(how: str, buffers: list[torch.Tensor], jobs, done, channel) -> Callable[[], None]:
    def work() -> None:
        if how == "before":
            jobs.put((how, 0, bytes(ForkingPickler.dumps(buffers))))
        else:
            payload, fds = BufferPickler.dumps(buffers, {}, {})
            send_descriptors(channel, fds)
            jobs.put((how, len(fds), payload))
        assert done.get(timeout=120) == len(buffers)

    return work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--buffers", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    setup_threads()
    loop = Loop()
    context = multiprocessing.get_context("spawn")
    jobs, done = context.Queue(), context.Queue()
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    child = context.Process(target=_receiver, args=(jobs, done, theirs), daemon=True)
    child.start()
    theirs.close()
    small = [shared_pages((4096,), torch.float32) for _ in range(args.buffers)]
    handover("now", small[:1], jobs, done, mine)()  # the child is up and has imported everything
    rounds: dict[str, list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        order = ("before", "now") if round_ % 2 == 0 else ("now", "before")
        for case in ("reserve", "handover"):
            for how in order:
                step_s = loop.median_step()
                kept: list[torch.Tensor] = []
                work = reserve(how, args.gib, kept) if case == "reserve" else handover(how, small, jobs, done, mine)
                rounds.setdefault(f"{case} {how}", []).append(loop.lost_while(work, step_s))
                del kept
    jobs.put(None)
    child.join(30)

    rows, results, targets = [], {}, []
    for key, values in rounds.items():
        lost, took = [v[0] for v in values], [v[1] for v in values]
        results[key] = {"lost_s": lost, "work_s": took, "lost_median_s": median(lost), "work_median_s": median(took)}
        rows.append([key, median(lost), spread(lost), median(took)])
    for case in ("reserve", "handover"):
        ratios = [now[0] / max(before[0], 1e-9) for now, before in zip(rounds[f"{case} now"], rounds[f"{case} before"])]
        results[f"{case} now / before"] = ratios
        targets.append(target(f"{case}: loop time lost, now / before", median(ratios), "<=", 0.25))
    print(f"{args.gib} GiB in 64 buffers made; {args.buffers} buffers handed over; {args.rounds} rounds")
    print(format_table(["case", "loop lost s", "range", "background s"], rows))
    print(format_targets(targets))
    write_results("writer_handover", vars(args), results, targets)


if __name__ == "__main__":
    main()
