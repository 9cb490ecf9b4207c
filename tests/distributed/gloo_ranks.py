"""Run a plain-torch function on several gloo ranks in spawned processes and collect what each rank returns.

For tests of torch-level rules (how DDP reduces, what a collective sums) that need no runner and no workspace:
cheaper than launching a training script per rank, and every rank's exception comes back with its traceback.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from tests.runs import free_port


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        try:
            results.put((rank, "ok", fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_on_gloo_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` spawned processes joined in one gloo group; the return values
    in rank order (they must pickle). `fn` must be importable by name (a module-level function)."""
    context = torch_mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            outcomes[rank] = value
    except queue.Empty:
        raise AssertionError(f"no result from ranks {sorted(set(range(world_size)) - set(outcomes))}") from None
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return [outcomes[rank] for rank in range(world_size)]
