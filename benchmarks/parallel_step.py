"""The parallel stack on 2 gloo ranks: its step time against a hand-written FSDP2 loop doing the same math, and a
DCP save of its sharded state against the same save on the torch stack.

Step time. Both sides train the same GPT (examples/gpt.py: 4 blocks, width 128, sequence 64, batch 8 per rank, no
dropout) with AdamW, FSDP2 over both ranks (`fully_shard` per block, then the root), reading the same data through
the same loader (`ResumableLoader`: StatefulDataLoader + ResumableSampler, sharded by rank). The hand loop is
zero_grad, forward, loss, backward, step. The runner is `stack=parallel` with checkpoints off and no validation
split, in its default config (the non-finite gradient check agreed by both ranks each step) and lean
(`skip_nonfinite_grad=false`). Each side reads a wall and a CPU clock at the start of every step's forward; the
time per step is the median over blocks of 10 steps after warm-up. Rounds are interleaved (the order alternates)
and the median of the per-round ratios is reported. Every round checks that both sides end with bit-identical
parameters (the comparison is of the same math).

DCP save. The same model and AdamW state (a 25M-parameter GPT, after one step), saved through the checkpoint
managers as the runners use them: `ParallelCheckpointManager` with the FSDP2-sharded model and optimizer (each rank
writes its shards), and `DCPCheckpointManager` with the replicated model of the torch stack (DCP spreads the
replicated tensors over the ranks, each written once); time until the checkpoint is committed, wall and rank 0's
CPU time, the two stacks alternating. The target is on the CPU-time ratio (the wall time of a save on a shared VM
follows the disk and the other jobs more than the code).

`--scale` compares the step alone at three widths (64, 128, 256: 0.23M to 3.3M parameters, the same batch, sequence
and depth) and prints the runner's extra time per step (wall and CPU) at each: it must not grow with the parameter
count. `--profile` runs cProfile over rank 0's hand loop and runner loop in their steady state instead (after the
warm-up steps; bench-results/parallel_step-{hand,runner}.prof) and prints the functions whose own time per step
differs most between the two (bench-results/parallel_step-difference.txt).

    python benchmarks/parallel_step.py [--steps 50] [--rounds 3] [--saves 5] [--scale] [--profile]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp
from _common import (
    RESULTS_DIR,
    SteadyProfile,
    format_table,
    format_targets,
    load_note,
    median,
    profile_difference,
    setup_threads,
    spread,
    target,
    write_results,
)

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

NAME = "parallel_step"
WORLD_SIZE = 2
STEP_MODEL = {"vocab": 256, "dim": 128, "heads": 4, "layers": 4, "block_size": 64, "dropout": 0.0}
SAVE_MODEL = {"vocab": 4096, "dim": 512, "heads": 8, "layers": 7, "block_size": 64, "dropout": 0.0}
BATCH = 8
LR = 1e-3
WARMUP = 10
BLOCK = 10
TARGET_RATIO = 1.02  # issue 37: within 2% of the hand loop
SAVE_TARGET_RATIO = 1.10
VARIANTS = ("hand", "runner", "runner-lean")
SCALE_DIMS = (64, 128, 256)  # 0.23M, 0.85M, 3.3M parameters: the same batch, sequence and depth


def token_dataset(samples: int) -> Any:
    from gpt import TokenWindows

    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, STEP_MODEL["vocab"], (samples * STEP_MODEL["block_size"] + 1,), generator=generator)
    return TokenWindows(tokens, STEP_MODEL["block_size"])


def shard(model: torch.nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor().clone() for name, p in model.named_parameters()}


def blocks_per_step(stamps: list[tuple[float, float]]) -> tuple[float, float]:
    """Median wall and CPU seconds per step over blocks of BLOCK steps, after the warm-up."""
    wall = [(stamps[i + BLOCK][0] - stamps[i][0]) / BLOCK for i in range(WARMUP, len(stamps) - BLOCK, BLOCK)]
    cpu = [(stamps[i + BLOCK][1] - stamps[i][1]) / BLOCK for i in range(WARMUP, len(stamps) - BLOCK, BLOCK)]
    return median(wall), median(cpu)


Stamps = list[tuple[float, float]]  # (wall, CPU) seconds at the start of each step


def hand_loop(
    steps: int, rank: int, on_step: Callable[[], None] = lambda: None
) -> tuple[Stamps, dict[str, torch.Tensor]]:
    from gpt import GPT, TokenLoss

    from perdure import ResumableLoader

    torch.manual_seed(0)
    model = GPT(**STEP_MODEL)
    shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = ResumableLoader(token_dataset(steps * BATCH * WORLD_SIZE), batch_size=BATCH, shuffle=True, seed=0,
                             rank=rank, world_size=WORLD_SIZE)  # fmt: skip
    criterion = TokenLoss()
    stamps = []
    optimizer.zero_grad(set_to_none=True)
    for inputs, targets in loader.iter_epoch(0):
        stamps.append((time.perf_counter(), time.process_time()))
        on_step()
        criterion(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    stamps.append((time.perf_counter(), time.process_time()))
    return stamps, full_parameters(model)


def runner_loop(
    steps: int, lean: bool, root: str, on_step: Callable[[], None] = lambda: None
) -> tuple[Stamps, dict[str, torch.Tensor]]:
    from gpt import GPT, TokenLoss

    from perdure import Runner, RunnerConfig

    stamps: list[tuple[float, float]] = []

    class Bench(Runner):
        def __init__(self, config):
            super().__init__(config)
            self.model = GPT(**STEP_MODEL)
            self.criterion = TokenLoss()
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
            self.datasets["train"] = token_dataset(steps * BATCH * WORLD_SIZE)

        def train_step(self, batch):
            stamps.append((time.perf_counter(), time.process_time()))
            on_step()
            return super().train_step(batch)

    config = RunnerConfig()
    config.stack, config.steps, config.seed = "parallel", steps, 0
    config.dataloader.batch_size = BATCH
    config.ckpt.enabled = False
    config.workspace.root = root
    config.log.interval = BLOCK if not lean else steps
    config.skip_nonfinite_grad = not lean
    config.parallel.fsdp.reshard_after_forward = True
    runner = Bench(config)
    runner.train()
    stamps.append((time.perf_counter(), time.process_time()))
    return stamps, full_parameters(runner.model)


def save_times(saves: int, root: Path, rank: int) -> dict[str, list[float]]:
    """Seconds to a committed checkpoint (wall and this rank's CPU), the sharded state (parallel stack) and the
    replicated one (torch stack) saved alternately."""
    from gpt import GPT, TokenLoss

    from perdure.checkpoints.base import CheckpointPolicy
    from perdure.checkpoints.commit import checkpoint_name
    from perdure.checkpoints.dcp import DCPCheckpointManager
    from perdure.checkpoints.sharded import ParallelCheckpointManager, ShardedModel, ShardedOptimizer
    from perdure.distributed.topology import Topology
    from perdure.runners.rng import RNGState
    from perdure.runners.state import RunnerState

    managers, states = {}, {}
    for stack in ("torch", "parallel"):
        torch.manual_seed(0)
        model = GPT(**SAVE_MODEL)
        if stack == "parallel":
            shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        inputs = torch.randint(0, SAVE_MODEL["vocab"], (2, SAVE_MODEL["block_size"]))
        TokenLoss()(model(inputs), inputs).backward()  # the same batch on both ranks: the replicas stay equal
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if stack == "parallel":
            manager_class = ParallelCheckpointManager
            states[stack] = {"model": ShardedModel([model]), "optimizer": ShardedOptimizer([model], optimizer)}
        else:
            manager_class = DCPCheckpointManager
            states[stack] = {"model": model, "optimizer": optimizer}
        states[stack] = {"state": RunnerState(), **states[stack]}
        identity = {"topology": Topology(shard=WORLD_SIZE).to_manifest()} if stack == "parallel" else {}
        managers[stack] = manager_class(root / stack, CheckpointPolicy(), rank=rank, world_size=WORLD_SIZE,
                                        identity=identity, token="bench", timeout_s=600)  # fmt: skip
    times: dict[str, list[float]] = {key: [] for key in ("torch", "parallel", "torch_cpu", "parallel_cpu")}
    for index in range(saves):
        for stack in ("torch", "parallel") if index % 2 == 0 else ("parallel", "torch"):
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            meta = {"global_step": index + 1}
            managers[stack].save(checkpoint_name(step=index + 1), states[stack], {"rng": RNGState()}, meta=meta)
            dist.barrier()
            times[stack].append(time.perf_counter() - started)
            times[f"{stack}_cpu"].append(time.process_time() - cpu_started)
    for stack, manager in managers.items():
        manager.close()
        written = (root / stack / checkpoint_name(step=saves)).iterdir()
        times[f"{stack}_bytes"] = [float(sum(path.stat().st_size for path in written))]
    return times


def profile_loops(steps: int, rank: int, scratch: str) -> dict[str, str]:
    """cProfile of rank 0's hand loop and runner loop in their steady state (from the first step after the warm-up to
    the end; one run each) and the table of the functions whose time per step differs most (`profile_difference`).
    The stats are written next to the results."""
    profiles = {}
    for variant in ("hand", "runner"):
        dist.barrier()
        profile = SteadyProfile(WARMUP)
        if variant == "hand":
            hand_loop(steps, rank, profile.tick)
        else:
            runner_loop(steps, False, os.path.join(scratch, "profiled"), profile.tick)
        profiles[variant] = (profile.profiler, profile.stop())
        if rank == 0:
            RESULTS_DIR.mkdir(exist_ok=True)
            profile.profiler.dump_stats(RESULTS_DIR / f"{NAME}-{variant}.prof")
    if rank != 0:
        return {}
    (hand, hand_steps), (runner, runner_steps) = profiles["hand"], profiles["runner"]
    path = RESULTS_DIR / f"{NAME}-difference.txt"
    path.write_text(profile_difference(hand, hand_steps, runner, runner_steps) + "\n")
    return {f"FSDP2: runner against the hand loop, {runner_steps} steps after the warm-up": str(path)}


def rank_main(rank: int, port: int, steps: int, rounds: int, saves: int, scratch: str, results: Any, dim: int,
              mode: str) -> None:  # fmt: skip
    """One rank: `mode` compare (step rounds, then saves), scale (step rounds only) or profile; the model `dim` wide."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    setup_threads()
    STEP_MODEL["dim"] = dim
    dist.init_process_group("gloo")
    import logging

    logging.getLogger("perdure").setLevel(logging.WARNING)
    if mode == "profile":
        profiles = profile_loops(steps, rank, scratch)
        if rank == 0:
            results.put({"profiles": profiles})
        dist.barrier()
        dist.destroy_process_group()
        return
    record: dict[str, Any] = {variant: {"wall": [], "cpu": []} for variant in VARIANTS}
    record["same_params"] = []
    for index in range(rounds):
        order = list(VARIANTS) if index % 2 == 0 else list(VARIANTS)[::-1]
        params = {}
        for variant in order:
            root = os.path.join(scratch, f"round{index}-{variant}")
            if variant == "hand":
                stamps, params[variant] = hand_loop(steps, rank)
            else:
                stamps, params[variant] = runner_loop(steps, variant == "runner-lean", root)
            wall, cpu = blocks_per_step(stamps)
            record[variant]["wall"].append(wall)
            record[variant]["cpu"].append(cpu)
        record["same_params"].append(
            all(torch.equal(params["hand"][name], params[v][name]) for v in VARIANTS[1:] for name in params["hand"])
        )
    if mode == "compare":
        record["saves"] = save_times(saves, Path(scratch) / "saves", rank)
    if rank == 0:
        results.put(record)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps per loop per round (the first 10 warm up)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median ratio is reported")
    parser.add_argument("--saves", type=int, default=5, help="saves per stack, alternating (median reported)")
    parser.add_argument("--scale", action="store_true", help="the runner's extra time per step at 3 model widths")
    parser.add_argument("--profile", action="store_true", help="cProfile rank 0's hand and runner loops instead")
    args = parser.parse_args(argv)
    threads = setup_threads()
    if args.profile:
        for name, path in launch(args, STEP_MODEL["dim"], "profile")["profiles"].items():
            print(f"== {name} ({path})\n{Path(path).read_text()}")
        return 0
    if args.scale:
        print_scale(args)
        return 0
    print(f"{NAME}: {WORLD_SIZE} gloo ranks, {args.rounds} rounds x {args.steps} steps, {args.saves} saves", flush=True)
    record = launch(args, STEP_MODEL["dim"], "compare")
    hand = record["hand"]
    summary: dict[str, Any] = {"hand": {"ms_per_step": median(hand["wall"]) * 1e3}}
    rows, targets = [["hand FSDP2 loop", median(hand["wall"]) * 1e3, median(hand["cpu"]) * 1e3, "", "", "", ""]], []
    same = all(record["same_params"])
    for variant in VARIANTS[1:]:
        ratios = [r / h for r, h in zip(record[variant]["wall"], hand["wall"])]
        cpu_ratios = [r / h for r, h in zip(record[variant]["cpu"], hand["cpu"])]
        summary[variant] = {
            "ms_per_step": median(record[variant]["wall"]) * 1e3,
            "ratio": median(ratios),
            "ratio_range": [min(ratios), max(ratios)],
            "cpu_ratio": median(cpu_ratios),
            "cpu_ratio_range": [min(cpu_ratios), max(cpu_ratios)],
            "same_params_as_hand": same,
        }
        rows.append([variant, median(record[variant]["wall"]) * 1e3, median(record[variant]["cpu"]) * 1e3,
                     median(ratios), spread(ratios), median(cpu_ratios), "yes" if same else "NO"])  # fmt: skip
    targets.append(target("parallel runner / hand FSDP2 loop time per step", summary["runner"]["ratio"], "<=",
                          TARGET_RATIO))  # fmt: skip
    targets.append(target("same final parameters as the hand loop (1 = yes)", float(same), ">=", 1.0))
    saves = record["saves"]
    save_ratio = median(p / t for p, t in zip(saves["parallel"], saves["torch"]))
    summary["dcp_save"] = {
        "parallel_s": median(saves["parallel"]),
        "torch_s": median(saves["torch"]),
        "ratio": save_ratio,
        "cpu_ratio": median(p / t for p, t in zip(saves["parallel_cpu"], saves["torch_cpu"])),
        "parallel_bytes": saves["parallel_bytes"][0],
        "torch_bytes": saves["torch_bytes"][0],
        "runs": {key: saves[key] for key in ("parallel", "torch", "parallel_cpu", "torch_cpu")},
    }
    # The target is on CPU time: the wall time of a save on this shared VM follows the disk and the other jobs
    metric = "DCP save CPU time, sharded (parallel) / replicated (torch stack)"
    targets.append(target(metric, summary["dcp_save"]["cpu_ratio"], "<=", SAVE_TARGET_RATIO))
    headers = ["loop", "ms/step", "cpu ms/step", "ratio", "ratio range", "cpu ratio", "same params"]
    print(format_table(headers, rows))
    print(format_table(
        ["DCP save, 2 ranks", "median s", "median cpu s", "MB"],
        [["parallel stack (FSDP2 shards)", median(saves["parallel"]), median(saves["parallel_cpu"]),
          saves["parallel_bytes"][0] / 1e6],
         ["torch stack (replicated)", median(saves["torch"]), median(saves["torch_cpu"]),
          saves["torch_bytes"][0] / 1e6]],
    ))  # fmt: skip
    print(format_targets(targets))
    config = {
        "world_size": WORLD_SIZE,
        "steps": args.steps,
        "rounds": args.rounds,
        "saves": args.saves,
        "step_model": STEP_MODEL,
        "save_model": SAVE_MODEL,
        "batch_per_rank": BATCH,
        "backend": "gloo",
        "torch_threads": threads,
    }
    if note := load_note():
        print(f"WARNING: {note}")
    print(f"results: {write_results(NAME, config, summary, targets)}")
    return 0


def launch(args: argparse.Namespace, dim: int, mode: str) -> dict[str, Any]:
    """Both ranks, spawned; rank 0's record."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = torch_mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="perdure-bench-") as scratch:
        torch_mp.start_processes(rank_main, args=(port, args.steps, args.rounds, args.saves, scratch, results, dim,
                                                  mode), nprocs=WORLD_SIZE, start_method="spawn")  # fmt: skip
        return dict(results.get(timeout=60))


def print_scale(args: argparse.Namespace) -> None:
    """The step comparison at each of SCALE_DIMS: the runner's extra time per step must not grow with the model."""
    from gpt import GPT

    print(f"{NAME} --scale: {WORLD_SIZE} gloo ranks, {args.rounds} rounds x {args.steps} steps per width", flush=True)
    rows = []
    for dim in SCALE_DIMS:
        parameters = sum(p.numel() for p in GPT(**{**STEP_MODEL, "dim": dim}).parameters())
        record = launch(args, dim, "scale")
        hand, runner = record["hand"], record["runner"]
        ratios = [r / h for r, h in zip(runner["wall"], hand["wall"])]
        cpu_ratios = [r / h for r, h in zip(runner["cpu"], hand["cpu"])]
        rows.append([f"{parameters / 1e6:.2f}M", median(hand["wall"]) * 1e3,
                     (median(runner["wall"]) - median(hand["wall"])) * 1e3,
                     (median(runner["cpu"]) - median(hand["cpu"])) * 1e3, median(ratios), median(cpu_ratios),
                     "yes" if all(record["same_params"]) else "NO"])  # fmt: skip
        print(f"dim {dim} done", flush=True)
    headers = ["parameters", "hand ms/step", "runner extra ms/step", "runner extra cpu ms/step", "ratio", "cpu ratio",
               "same params"]  # fmt: skip
    print(format_table(headers, rows))
    if note := load_note():
        print(f"WARNING: {note}")


if __name__ == "__main__":
    sys.exit(main())
