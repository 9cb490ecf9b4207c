"""DCP checkpoints of a ~100M-parameter model with AdamW state: save time on 1 vs 2 ranks, stall per async save.

    python benchmarks/dcp_save.py [--repeats 3]

Each configuration runs in fresh processes (ranks started as torchrun would, gloo on the CPU) and saves the same
model `repeats` times through `DCPCheckpointManager.save` (sharded write, per-rank checksums, commit by rank 0):
- sync, 1 rank and 2 ranks: time until the checkpoint is committed (the baseline is the 1-rank save);
- async thread, 1 and 2 ranks: time the caller is blocked (the snapshot, until its copy is done) against the sync save.
  No forward / backward runs here to hide the copy behind, so this stall is an upper bound of a training loop's
  (`async_stall.py` measures the loop itself).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS_DIR, format_table, format_targets, setup_threads, target, write_results

CONFIGS = (("disabled", 1), ("disabled", 2), ("thread", 1), ("thread", 2))


def worker(mode: str, root: Path, repeats: int) -> None:
    """One rank: build the state, save it `repeats` times, print rank 0's timings as JSON."""
    setup_threads()
    import torch
    import torch.distributed as dist
    from torch import nn

    from perdure.checkpoints.base import CheckpointPolicy
    from perdure.checkpoints.commit import checkpoint_name
    from perdure.checkpoints.dcp import DCPCheckpointManager
    from perdure.runners.rng import RNGState
    from perdure.runners.state import RunnerState

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(6)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.randn_like(parameter) * 1e-3
    optimizer.step()
    optimizer.zero_grad()
    policy = CheckpointPolicy(async_mode=mode)
    manager = DCPCheckpointManager(root, policy, rank=rank, world_size=world_size, token="bench", timeout_s=600)
    manager.start()
    blocked, committed = [], []
    for index in range(repeats):
        if world_size > 1:
            dist.barrier()
        started = time.perf_counter()
        manager.save(
            checkpoint_name(step=index + 1),
            {"state": RunnerState(), "model": model, "optimizer": optimizer},
            {"rng": RNGState()},
            meta={"global_step": index + 1},
            deferred=list(model.parameters()),
        )
        manager.wait_for_snapshots()
        blocked.append(time.perf_counter() - started)
        manager.drain()
        if world_size > 1:
            dist.barrier()
        committed.append(time.perf_counter() - started)
    manager.close()
    if rank == 0:
        size = sum(path.stat().st_size for path in (root / checkpoint_name(step=repeats)).iterdir())
        parameters = sum(p.numel() for p in model.parameters())
        print(json.dumps({"blocked_s": blocked, "committed_s": committed, "bytes": size, "parameters": parameters}))
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


def launch(mode: str, world_size: int, repeats: int, scratch: Path) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = scratch / f"{mode}-{world_size}"
    processes = []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        command = [sys.executable, __file__, "--worker", mode, "--root", str(root), "--repeats", str(repeats)]
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [process.communicate(timeout=1200) for process in processes]
    for process, (_, errors) in zip(processes, outputs):
        if process.returncode != 0:
            raise SystemExit(f"{mode} on {world_size} ranks failed:\n{errors[-3000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: this process is one rank
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.root), args.repeats)
        return

    RESULTS_DIR.mkdir(exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR) as scratch:
        for mode, world_size in CONFIGS:
            measured = launch(mode, world_size, args.repeats, Path(scratch))
            key = f"{'sync' if mode == 'disabled' else 'async ' + mode}, {world_size} rank{'s' * (world_size > 1)}"
            results[key] = {
                **measured,
                "blocked_median_s": statistics.median(measured["blocked_s"]),
                "committed_median_s": statistics.median(measured["committed_s"]),
            }
            print(f"{key}: {results[key]['committed_median_s']:.2f}s", file=sys.stderr)

    sync1, sync2 = results["sync, 1 rank"], results["sync, 2 ranks"]
    print(f"model: {sync1['parameters'] / 1e6:.0f}M parameters, checkpoint {sync1['bytes'] / 1e9:.2f} GB")
    rows = [
        [key, r["blocked_median_s"], r["committed_median_s"], r["bytes"] / 1e9 / r["committed_median_s"]]
        for key, r in results.items()
    ]
    print(format_table(["configuration", "loop blocked s", "until committed s", "GB/s"], rows))
    targets = [
        target("sync save, 2 ranks / 1 rank", sync2["committed_median_s"] / sync1["committed_median_s"], "<=", 1.0),
        target(
            "async stall / sync save, 1 rank",
            results["async thread, 1 rank"]["blocked_median_s"] / sync1["committed_median_s"],
            "<=",
            0.1,
        ),
        target(
            "async stall / sync save, 2 ranks",
            results["async thread, 2 ranks"]["blocked_median_s"] / sync2["committed_median_s"],
            "<=",
            0.1,
        ),
    ]
    print(format_targets(targets))
    write_results("dcp_save", {"repeats": args.repeats}, results, targets)


if __name__ == "__main__":
    main()
