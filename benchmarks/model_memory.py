"""Peak memory per rank of building a ~200M-parameter model, one training step and one checkpoint: the model built on
the meta device (stack=parallel, FSDP2 on 4 ranks) or partitioned as it is built (stack=deepspeed, ZeRO-3 on 2 ranks,
`deepspeed.zero.Init`), both through `with self.init_module():`, against the same model built whole on every rank.

The model is 12 x Linear(4096, 4096) (201.4M parameters, 806 MB in fp32, `M` below), trained with AdamW in fp32 on
random data (batch 4 per rank); ZeRO-3's buckets are sized as Hugging Face's "auto" sizes them (`DEEPSPEED_BUCKETS`:
DeepSpeed's defaults, 5e8 elements per buffer, would outweigh the model's shards). Every case runs in fresh
processes, one per rank, launched as torchrun would. Each rank reads its resident memory after its imports (the
baseline) and its peak resident memory (`VmHWM`, /proc/self/status) after each phase: `construct` (the model
built in the program's `__init__`), `build` (the runner built: sharding or partitioning, materialisation, the
state-dict check, DeepSpeed's engine), `step` (one optimizer step), `checkpoint` (one checkpoint committed: DCP or
DeepSpeed's engine files) and `export` (model.pth; with `--ema` model-ema.pth too). The table gives the largest rise
over the ranks as a multiple of M; `ckpt alone` and `export alone` are the rise of that phase alone over the resident
memory at its start (VmHWM reset there through /proc/self/clear_refs), which a cumulative peak reached earlier (the
step's) would hide; on a GPU the JSON also holds each phase's
`torch.cuda.max_memory_allocated` (`gpu_over_M`; not measured here: this machine has no GPU).

The sharded training state of a rank (`training_state`): on FSDP2 4 M / world_size (fp32 parameters, gradients and
AdamW's two moments: each rank's share); under ZeRO-3 5 M / world_size (DeepSpeed keeps its own flat fp32 master copy
beside the parameter partitions, even in fp32) plus its reduce and prefetch buckets; with `--ema`, M / world_size more
(the shadows). Target (issue 38): building on meta (partitioned) adds at most M / world_size + 0.1 M per rank over that
state, through the checkpoint: peak(checkpoint) <= state + (1 / world_size + 0.1) M. `zero3-hand` is ZeRO-3 written by
hand (`hand_loop`): the runner's ZeRO-3 peak over its peak is what perdure adds to what DeepSpeed itself holds.
`--sub-group-size N` sets DeepSpeed's `sub_group_size` (its default, 1e9 elements, steps a rank's whole partition at
once: a flattened copy of its gradients and AdamW's temporaries as large as the partition).

glibc keeps freed blocks mapped (a freed full-size tensor stays resident and is reused), so the figures depend on the
allocator: each case runs with glibc's defaults and with `MALLOC_MMAP_THRESHOLD_=131072` (every block of 128 KiB or
more is its own mapping, returned when freed); the setting is printed beside each figure.

    python benchmarks/model_memory.py [--width 4096] [--depth 12] [--cases fsdp2-meta fsdp2-eager ...]
                                      [--allocators default mmap]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import format_table, format_targets, load_note, target, write_results

REPO = Path(__file__).resolve().parent.parent
NAME = "model_memory"
# case: (stack, ranks, how the model is built)
CASES = {
    "fsdp2-meta": ("parallel", 4, "init_module"),
    "fsdp2-eager": ("parallel", 4, "eager"),
    "zero3-partitioned": ("deepspeed", 2, "init_module"),
    "zero3-eager": ("deepspeed", 2, "eager"),
    "zero3-hand": ("deepspeed", 2, "hand"),
}
ALLOCATORS = {"default": {}, "mmap": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
PHASES = ("construct", "build", "step", "checkpoint", "export")
OWN = ("checkpoint", "export")  # phases also measured alone: their rise over the resident memory at their start
HEADER = ["case", "ranks", "allocator", *PHASES, "ckpt alone", "export alone", "state", "target", "load"]


def DEEPSPEED_BUCKETS(width: int, sub_group: int | None = None) -> dict[str, Any]:  # noqa: N802  (a table)
    """ZeRO-3's communication buffers sized to the model, as Hugging Face's "auto" sizes them (hidden size squared):
    DeepSpeed's defaults (5e8 elements: 2 GB in fp32 per buffer) would be larger than the model's shards here. With
    `sub_group`, DeepSpeed's `sub_group_size` (default 1e9 elements: the optimizer steps a rank's whole partition at
    once, its flattened gradients and AdamW's temporaries as large as the partition)."""
    settings: dict[str, Any] = {
        "reduce_bucket_size": width * width,
        "stage3_prefetch_bucket_size": int(0.9 * width * width),
        "stage3_param_persistence_threshold": 10 * width,
    }
    if sub_group is not None:
        settings["sub_group_size"] = sub_group
    return {"zero_optimization": settings}


BATCH = 4


def memory(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak resident) of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


def training_state(stack: str, ranks: int, width: int, model_bytes: int, ema: bool) -> float:
    """A rank's sharded training state in units of M (see the module docstring): FSDP2 4 M / ranks (parameters,
    gradients, AdamW's two moments); ZeRO-3 5 M / ranks (DeepSpeed's parameter partitions, its flat fp32 master copy
    of them, its flat gradient partitions, AdamW's two moments over the master copy) plus its reduce and prefetch
    buckets (`DEEPSPEED_BUCKETS`, fp32); with EMA, M / ranks more (the shadows of the rank's shards)."""
    state = (4 if stack == "parallel" else 5) / ranks + (1 / ranks if ema else 0)
    if stack == "deepspeed":
        buckets = DEEPSPEED_BUCKETS(width)["zero_optimization"]
        state += 4 * (buckets["reduce_bucket_size"] + buckets["stage3_prefetch_bucket_size"]) / model_bytes
    return state


def worker(case: str, width: int, depth: int, root: str, out: str, ema: bool, sub_group: int | None) -> None:
    """One rank of one case: build, train one step, commit one checkpoint, export; the peaks after each phase. With
    `ema`, `ema.enabled` (its shadows, their update, their save and model-ema.pth are in the figures)."""
    import torch
    from torch import nn

    sys.path.insert(0, str(REPO))
    from perdure import Runner, RunnerConfig

    stack, _, build = CASES[case]
    if stack == "deepspeed":
        import deepspeed  # noqa: F401  (its import is part of the baseline, not of the model)
    cuda = torch.cuda.is_available()
    peaks: dict[str, Any] = {"start": memory("VmRSS")}

    def note(phase: str) -> None:
        # the peak since the program's start: VmHWM, or the last phase's when a phase of its own reset VmHWM
        peaks[phase] = max([memory("VmHWM"), *(peaks[p] for p in PHASES if p in peaks)])
        if cuda:
            peaks[f"{phase}_gpu"] = torch.cuda.max_memory_allocated()

    def own_start(phase: str) -> None:
        """The rise of `phase` alone, from here: VmHWM reset to the resident memory now (what the phases before
        left resident does not hide what this one adds)."""
        note(f"before_{phase}")
        Path("/proc/self/clear_refs").write_text("5")
        peaks[f"{phase}_from"] = memory("VmRSS")

    def own_end(phase: str) -> None:
        peaks[f"{phase}_own"] = memory("VmHWM") - peaks[f"{phase}_from"]
        note(phase)

    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x[:, :2]

    class Bench(Runner):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            with self.init_module() if build == "init_module" else contextlib.nullcontext():
                self.model = Wide()
            note("construct")
            self.criterion = nn.CrossEntropyLoss()
            generator = torch.Generator().manual_seed(0)
            inputs = torch.randn(BATCH * 8, width, generator=generator)
            targets = torch.randint(0, 2, (BATCH * 8,), generator=generator)
            self.datasets["train"] = torch.utils.data.TensorDataset(inputs, targets)

        def optimizer_step(self) -> bool:
            applied = super().optimizer_step()
            note("step")
            return applied

        def save_checkpoint(self, reason: str) -> Path | None:
            own_start("checkpoint")
            path = super().save_checkpoint(reason)
            if path is not None:
                own_end("checkpoint")
            return path

        def write_final_exports(self) -> None:
            own_start("export")
            super().write_final_exports()
            own_end("export")

    config = RunnerConfig()
    if build == "hand":
        hand_loop(Wide, width, sub_group, note, own_start, own_end, root)
        Path(out).write_text(json.dumps(peaks))
        return
    config.stack, config.steps, config.seed = stack, 1, 0
    config.dataloader.batch_size = BATCH
    config.ckpt.interval = 1
    config.workspace.root = root
    config.workspace.code_id = "bench"
    config.log.interval = 1
    config.ema.enabled = ema
    if stack == "deepspeed":
        config.deepspeed.zero_stage = 3
        config.deepspeed.config = DEEPSPEED_BUCKETS(width, sub_group)
    runner = Bench(config)
    note("build")
    runner.train()
    runner.close()
    Path(out).write_text(json.dumps(peaks))


def hand_loop(
    model: Any, width: int, sub_group: int | None, note: Any, own_start: Any, own_end: Any, root: str
) -> None:
    """ZeRO-3 written by hand, the DeepSpeed way, with what the runner gives DeepSpeed: the model built under
    `deepspeed.zero.Init` and `deepspeed.initialize` with the same engine config (`engine_config` of the runner's
    config, `DEEPSPEED_BUCKETS`) and the runner's default optimizer (AdamW, `optim.*`); one step on a batch of the same
    size; `engine.save_checkpoint` (DeepSpeed's own files: no manifest, no fsync). No export: DeepSpeed's
    `save_16bit_model` is off under ZeRO-3 unless its gather option is set."""
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from perdure import RunnerConfig
    from perdure.runners.deepspeed_config import engine_config
    from perdure.runners.optim import build_optimizer

    config = RunnerConfig()
    config.stack, config.seed = "deepspeed", 0
    config.dataloader.batch_size = BATCH
    config.deepspeed.zero_stage = 3
    config.deepspeed.config = DEEPSPEED_BUCKETS(width, sub_group)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    settings = engine_config(config, torch.distributed.get_world_size())
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=settings):
        module = model()
    note("construct")
    optimizer = build_optimizer(module.parameters(), config.optim)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=settings)
    note("build")
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(BATCH, width, generator=generator)
    targets = torch.randint(0, 2, (BATCH,), generator=generator)
    loss = torch.nn.functional.cross_entropy(engine(inputs), targets)
    engine.backward(loss)
    engine.step()
    note("step")
    own_start("checkpoint")
    engine.save_checkpoint(f"{root}/hand", tag="step1")
    torch.distributed.barrier()
    own_end("checkpoint")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_case(
    case: str, allocator: str, width: int, depth: int, ema: bool, sub_group: int | None
) -> list[dict[str, Any]]:
    """Launch the ranks of one case in fresh processes; each rank's peaks."""
    _, ranks, _ = CASES[case]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="model-memory-") as scratch:
        processes = []
        for rank in range(ranks):
            env = {
                **os.environ,
                **ALLOCATORS[allocator],
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
            }
            command = [sys.executable, __file__, "--worker", case, "--width", str(width), "--depth", str(depth),
                       "--root", f"{scratch}/runs", "--out", f"{scratch}/rank{rank}.json",
                       *(["--ema"] if ema else []),
                       *(["--sub-group-size", str(sub_group)] if sub_group is not None else [])]  # fmt: skip
            processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [process.communicate()[0].decode(errors="replace") for process in processes]
        for rank, process in enumerate(processes):
            if process.returncode != 0:
                raise RuntimeError(f"{case} rank {rank} exited {process.returncode}:\n{outputs[rank][-4000:]}")
        return [json.loads(Path(f"{scratch}/rank{rank}.json").read_text()) for rank in range(ranks)]


def against_hand(results: dict[str, Any], allocator: str) -> list[str]:
    """ZeRO-3's peaks through the checkpoint, the runner's over the hand-written loop's (the same engine, model and
    optimizer), when both ran under `allocator`: what perdure adds to what DeepSpeed itself holds. Reported, no
    target: the issue's target is the one above."""
    hand = results.get(f"zero3-hand/{allocator}")
    if hand is None:
        return []
    setting = "glibc default" if allocator == "default" else "MALLOC_MMAP_THRESHOLD_=131072"
    lines = []
    for case in ("zero3-partitioned", "zero3-eager"):
        runner = results.get(f"{case}/{allocator}")
        if runner is not None:
            ratio = runner["rise_over_M"]["checkpoint"] / hand["rise_over_M"]["checkpoint"]
            runner["over_hand"] = ratio
            lines.append(f"{case} / zero3-hand ({setting}) checkpoint peak: {ratio:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=list(ALLOCATORS))
    parser.add_argument("--worker", choices=list(CASES))
    parser.add_argument("--root")
    parser.add_argument("--out")
    parser.add_argument("--ema", action="store_true", help="train with ema.enabled (default: without)")
    parser.add_argument("--sub-group-size", type=int, help="ZeRO-3's sub_group_size (default: DeepSpeed's, 1e9)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.width, args.depth, args.root, args.out, args.ema, args.sub_group_size)
        return
    parameters = args.depth * (args.width * args.width + args.width)
    model_bytes = 4 * parameters
    print(f"model: {args.depth} x Linear({args.width}, {args.width}) = {parameters / 1e6:.1f}M parameters, "
          f"M = {model_bytes / 1e6:.0f} MB in fp32; figures: each phase's peak rise over the baseline, max over "
          "ranks, in units of M", flush=True)  # fmt: skip
    results: dict[str, Any] = {}
    rows, targets, ratios = [], [], []
    for allocator in args.allocators:
        for case in args.cases:
            stack, ranks, build = CASES[case]
            per_rank = run_case(case, allocator, args.width, args.depth, args.ema, args.sub_group_size)
            rises = {
                phase: max(peaks[phase] - peaks["start"] for peaks in per_rank) / model_bytes
                for phase in PHASES
                if all(phase in peaks for peaks in per_rank)
            }
            own = {
                phase: max(peaks[f"{phase}_own"] for peaks in per_rank) / model_bytes
                for phase in OWN
                if all(f"{phase}_own" in peaks for peaks in per_rank)
            }
            gpu = {
                phase: max(peaks[f"{phase}_gpu"] for peaks in per_rank) / model_bytes
                for phase in PHASES
                if all(f"{phase}_gpu" in peaks for peaks in per_rank)
            }
            state = training_state(stack, ranks, args.width, model_bytes, args.ema)
            bound = state + 1 / ranks + 0.1
            results[f"{case}/{allocator}"] = {"ranks": per_rank, "rise_over_M": rises, "own_rise_over_M": own,
                                              "gpu_over_M": gpu, "load": os.getloadavg()}  # fmt: skip
            setting = "glibc default" if allocator == "default" else "MALLOC_MMAP_THRESHOLD_=131072"
            rows.append([case, ranks, setting, *(rises.get(phase, float("nan")) for phase in PHASES),
                         *(own.get(phase, float("nan")) for phase in OWN), state, bound,
                         f"{os.getloadavg()[0]:.1f}"])  # fmt: skip
            if build == "init_module":
                targets.append(
                    target(f"{case} ({setting}) checkpoint peak / M", rises["checkpoint"], "<=", round(bound, 3))
                )
            print(format_table(HEADER, rows[-1:]), flush=True)
        ratios.extend(against_hand(results, allocator))
    print()
    print(format_table(HEADER, rows))
    print(format_targets(targets))
    print("\n".join(ratios))
    note = load_note()
    if note:
        print(note)
    config = {"width": args.width, "depth": args.depth, "parameters": parameters, "model_bytes": model_bytes,
              "batch": BATCH, "cases": args.cases, "allocators": args.allocators, "ema": args.ema,
              "sub_group_size": args.sub_group_size}  # fmt: skip
    write_results(NAME, config, results, targets)


if __name__ == "__main__":
    main()
