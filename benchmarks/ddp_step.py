"""DDP step time: perdure's `FixedLayoutDDP` against plain `DistributedDataParallel`, on 2 and 4 gloo ranks.

`FixedLayoutDDP` (issue 17) fixes the gradient bucket layout before the first step instead of letting DDP rebuild it
after the first iteration, so that a resumed process reduces exactly as the uninterrupted one. This measures what it
costs in the steady state: both sides run the same hand-written DDP loop (zero_grad, forward, loss, backward, AdamW
step) on the same data, interleaved round by round (the order alternates), and the median of the per-round ratios of
the time per step (after warm-up steps, which include plain DDP's rebuild) is reported per world size, in wall time
and in rank 0's process CPU time (communication threads included; immune to other processes' load). It also
records each wrap's bucket layout after its rebuild, as parameter names: when the two are equal, both sides issue the
same all-reduces from the second step on and the ratio can only show noise.

Models: `mlp-small` (the step_overhead MLP, 0.3 MB of gradients: one bucket) and `mlp-wide` (6 x Linear(1024, 1024),
25 MB: a 4 MB first bucket whose all-reduce overlaps the rest of the backward, then a 21 MB one).

    python benchmarks/ddp_step.py [--world-sizes 2 4] [--steps 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from _common import format_table, format_targets, load_note, median, setup_threads, spread, target, write_results
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perdure.distributed.ddp import FixedLayoutDDP  # noqa: E402

NAME = "ddp_step"
TARGET_RATIO = 1.02
WRAPPERS = {"plain": DistributedDataParallel, "fixed": FixedLayoutDDP}
MODELS = {"mlp-small": (256, 256, 2, 64), "mlp-wide": (1024, 1024, 6, 32)}  # features, width, layers, batch
WARMUP_STEPS = 5


def make_model(features: int, width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    body = [module for i in range(layers) for module in (nn.Linear(features if i == 0 else width, width), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(width, 10))


def layout(wrapped: DistributedDataParallel) -> list[list[str]]:
    """The buckets after the rebuild, as lists of parameter names (the reducer's indices are wrapper-specific)."""
    names = {parameter: name for name, parameter in wrapped.module.named_parameters()}
    by_index = [names[parameter] for parameter in wrapped._build_params_for_reducer()[0]]
    indices = wrapped._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices", "")
    return [[by_index[int(i)] for i in bucket.split()] for bucket in indices.split(",") if bucket.strip()]


def time_steps(wrapper: type, spec: tuple[int, int, int, int], steps: int, rank: int) -> tuple[float, float, list]:
    features, width, layers, batch = spec
    model = make_model(features, width, layers)
    wrapped = wrapper(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    inputs = torch.randn(batch, features, generator=generator)
    target = torch.randint(0, 10, (batch,), generator=generator)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(wrapped(inputs), target).backward()
        optimizer.step()

    for _ in range(WARMUP_STEPS):
        step()
    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    cpu = time.process_time() - cpu_started  # this rank's process, its communication threads included
    dist.barrier()
    return (time.perf_counter() - started) / steps, cpu / steps, layout(wrapped)


def rank_main(rank: int, world_size: int, port: int, steps: int, rounds: int, results: Any) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    record: dict[str, Any] = {}
    for model, spec in MODELS.items():
        seconds: dict[str, list[float]] = {name: [] for name in WRAPPERS}
        cpu_seconds: dict[str, list[float]] = {name: [] for name in WRAPPERS}
        layouts = {}
        for index in range(rounds):
            order = list(WRAPPERS) if index % 2 == 0 else list(WRAPPERS)[::-1]
            for name in order:
                per_step, cpu_per_step, layouts[name] = time_steps(WRAPPERS[name], spec, steps, rank)
                seconds[name].append(per_step)
                cpu_seconds[name].append(cpu_per_step)
        record[model] = {"seconds": seconds, "cpu_seconds": cpu_seconds, "layouts": layouts}
    if rank == 0:
        results.put(record)
    dist.destroy_process_group()


def measure(world_size: int, steps: int, rounds: int) -> dict[str, Any]:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = torch_mp.get_context("spawn")
    results = context.Queue()
    torch_mp.start_processes(
        rank_main, args=(world_size, port, steps, rounds, results), nprocs=world_size, start_method="spawn"
    )
    return results.get(timeout=60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per wrap per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median ratio is reported")
    args = parser.parse_args(argv)
    threads = setup_threads()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print(f"{NAME}: {args.rounds} rounds x {args.steps} steps per wrap, world sizes {args.world_sizes}", flush=True)
    summary: dict[str, Any] = {}
    rows, targets = [], []
    for world_size in args.world_sizes:
        record = measure(world_size, args.steps, args.rounds)
        for model, data in record.items():
            plain, fixed = data["seconds"]["plain"], data["seconds"]["fixed"]
            ratios = [f / p for f, p in zip(fixed, plain)]
            cpu_ratios = [f / p for f, p in zip(data["cpu_seconds"]["fixed"], data["cpu_seconds"]["plain"])]
            same_layout = data["layouts"]["plain"] == data["layouts"]["fixed"]
            summary[f"{model}, {world_size} ranks"] = {
                "plain_ms_per_step": median(plain) * 1e3,
                "fixed_ms_per_step": median(fixed) * 1e3,
                "ratio": median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "ratio_stdev": statistics.pstdev(ratios),
                "cpu_ratio": median(cpu_ratios),
                "cpu_ratio_range": [min(cpu_ratios), max(cpu_ratios)],
                "same_layout_as_plain_after_rebuild": same_layout,
                "layouts": data["layouts"],
                "rounds": {"plain": plain, "fixed": fixed},
            }
            rows.append([model, world_size, median(plain) * 1e3, median(fixed) * 1e3, median(ratios),
                         spread(ratios), median(cpu_ratios), spread(cpu_ratios),
                         "yes" if same_layout else "NO"])  # fmt: skip
            metric = f"fixed / plain DDP time per step, {model}, {world_size} ranks"
            targets.append(target(metric, median(ratios), "<=", TARGET_RATIO))
    headers = ["model", "ranks", "plain ms/step", "fixed ms/step", "ratio", "ratio range", "cpu ratio",
               "cpu ratio range", "same layout"]  # fmt: skip
    print(format_table(headers, rows))
    print(format_targets(targets))
    config = {
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup_steps": WARMUP_STEPS,
        "models": {name: dict(zip(("features", "width", "layers", "batch"), spec)) for name, spec in MODELS.items()},
        "backend": "gloo",
        "torch_threads": threads,
        "ratio": "median over rounds of fixed / plain wall time per step (after warm-up, between barriers); cpu "
        "ratio: the same in rank 0's process CPU time (immune to other processes' load)",
    }
    if note := load_note():
        print(f"WARNING: {note}")
    print(f"results: {write_results(NAME, config, summary, targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
