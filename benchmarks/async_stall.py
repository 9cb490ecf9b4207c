"""Loop stall per checkpoint: async (thread / process) against sync saves and against no checkpoints at all.

    python benchmarks/async_stall.py [--steps 24] [--interval 6] [--width 4096] [--depth 6]

A ~100M-parameter MLP with AdamW trains on the CPU for `steps` steps, saving every `interval` steps, once per mode,
each mode in a fresh process (so peak RSS is its own). Per mode it reports:
- loop stall per save: time the training loop spends inside `save_checkpoint` plus waiting for the snapshot before
  the next optimizer step (the only places a save can block it);
- total wall time of `train()` (for async modes this includes draining the last write);
- peak RSS (VmHWM) against the model + optimizer state size (parameters and AdamW moments): the whole peak over the
  state, and what the async save adds to the peak of the same training without checkpoints (gradients, activations
  and the interpreter are there either way), over the state.
Targets (issue 4): async stall per save <= 0.1 x a sync save; total time async <= sync; the memory an async save
adds <= 2 x the state (one snapshot copy is 1 x).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS_DIR, format_table, format_targets, setup_threads, target, write_results

from perdure.checkpoints.file import FileCheckpointManager

MODES = ("none", "disabled", "thread", "process")
SAVE_SECONDS: list[float] = []  # time the loop spent in save_checkpoint, per call
WAIT_SECONDS: list[float] = []  # time the loop waited for snapshots before optimizer steps


class TimedFileManager(FileCheckpointManager):
    """Times the loop's waits for snapshots (module level, so the spawned writer process can load the class)."""

    def wait_for_snapshots(self) -> None:
        started = time.perf_counter()
        super().wait_for_snapshots()
        WAIT_SECONDS.append(time.perf_counter() - started)


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict:
    """One training run in this process; returns its measurements."""
    setup_threads()
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from perdure import Runner, RunnerConfig

    floor_kib = rss_kib("VmRSS")

    class Config(RunnerConfig):
        def __init__(self):
            super().__init__()
            self.steps = args.steps
            self.ckpt.interval = args.interval
            self.ckpt.enabled = mode != "none"
            self.ckpt.async_mode = "disabled" if mode == "none" else mode
            self.log.interval = 10**9
            self.dataloader.batch_size = 8
            self.workspace.root = str(root)
            self.workspace.id = mode

    class BigRunner(Runner):
        checkpoint_manager_class = TimedFileManager

        def __init__(self, config):
            super().__init__(config)
            layers = []
            for _ in range(args.depth):
                layers += [nn.Linear(args.width, args.width), nn.ReLU()]
            self.model = nn.Sequential(*layers, nn.Linear(args.width, 2))
            self.criterion = nn.CrossEntropyLoss()
            generator = torch.Generator().manual_seed(0)
            inputs = torch.randn(64, args.width, generator=generator)
            self.datasets["train"] = TensorDataset(inputs, (inputs[:, 0] > 0).long())

        def save_checkpoint(self, reason):
            started = time.perf_counter()
            try:
                return super().save_checkpoint(reason)
            finally:
                SAVE_SECONDS.append(time.perf_counter() - started)

    runner = BigRunner(Config())
    state_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters()) * 3  # params + AdamW moments
    started = time.perf_counter()
    runner.train()
    total = time.perf_counter() - started
    saves = len(list(root.glob(f"*/{mode}/checkpoints/ckpt-*"))) if mode != "none" else 0
    stalled = sum(SAVE_SECONDS) + sum(WAIT_SECONDS)
    return {
        "mode": mode,
        "total_s": total,
        "saves": saves,
        "stall_per_save_s": stalled / saves if saves else 0.0,
        "in_save_checkpoint_s": sum(SAVE_SECONDS),
        "waiting_for_snapshots_s": sum(WAIT_SECONDS),
        "peak_rss_gb": rss_kib("VmHWM") / 2**20,
        "floor_rss_gb": floor_kib / 2**20,
        "state_gb": state_bytes / 2**30,
        "parameters": sum(p.numel() for p in runner.model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--interval", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one mode in this process
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(run_mode(args.mode, args, Path(args.root))))
        return

    results = {}
    RESULTS_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR) as scratch:  # on the repo's disk, git-ignored
        for mode in MODES:
            command = [sys.executable, __file__, "--mode", mode, "--root", scratch]
            command += ["--steps", str(args.steps), "--interval", str(args.interval)]
            command += ["--width", str(args.width), "--depth", str(args.depth)]
            output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results[mode] = json.loads(output.strip().splitlines()[-1])
            print(f"{mode}: {results[mode]['total_s']:.1f}s", file=sys.stderr)

    sync_stall = results["disabled"]["stall_per_save_s"]
    rows = []
    for mode in MODES:
        r = results[mode]
        r["peak_over_state"] = r["peak_rss_gb"] / r["state_gb"]
        r["added_over_state"] = (r["peak_rss_gb"] - results["none"]["peak_rss_gb"]) / r["state_gb"]
        rows.append(
            [
                {"none": "no checkpoints", "disabled": "sync"}.get(mode, f"async {mode}"),
                r["saves"],
                r["stall_per_save_s"],
                r["stall_per_save_s"] / sync_stall if sync_stall and mode != "none" else "",
                r["total_s"],
                r["peak_rss_gb"],
                r["peak_over_state"],
                r["added_over_state"],
            ]
        )
    print(f"model: {results['none']['parameters'] / 1e6:.0f}M parameters, {results['none']['state_gb']:.2f} GiB state")
    headers = ["mode", "saves", "stall/save s", "x sync stall", "total s", "peak RSS GiB", "peak/state", "added/state"]
    print(format_table(headers, rows))
    targets = []
    for mode in ("thread", "process"):
        targets.append(target(f"{mode} stall / sync stall", results[mode]["stall_per_save_s"] / sync_stall, "<=", 0.1))
        targets.append(target(f"{mode} total / sync total", results[mode]["total_s"] / results["disabled"]["total_s"],
                              "<=", 1.0))  # fmt: skip
        targets.append(target(f"{mode} peak RSS added by saving / state", results[mode]["added_over_state"], "<=", 2.0))
    print(format_targets(targets))
    config = {"steps": args.steps, "interval": args.interval, "width": args.width, "depth": args.depth}
    write_results("async_stall", config, results, targets)


if __name__ == "__main__":
    main()
