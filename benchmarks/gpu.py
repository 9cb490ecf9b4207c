"""GPU benchmark (issue 9): the runner's step time against a hand-written CUDA loop, and the loop stall of an async
checkpoint against a sync one, for a model of more than 400M parameters. Without CUDA it prints one line and exits 0.

    python benchmarks/gpu.py [--rounds 3] [--skip-stall] [--skip-steps]
    python benchmarks/gpu.py --device cpu --smoke    # the code paths on a CPU, tiny sizes: no measurement
    python benchmarks/gpu.py --skip-steps --interval 90 --stall-steps 271 --profile DIR
        # also torch.profiler traces (chrome format) of the steps around the second thread / process save, in DIR:
        # where a save's time goes; the profiler's own cost distorts those runs' stall numbers

Step time (`mlp`: 3 x Linear(2048) fp32; `gpt`: a 6-layer GPT, d 512, bf16 autocast): both sides read the same data
through the same loader class and sampler (torchdata StatefulDataLoader + perdure's ResumableSampler; pinned, moved
with non_blocking), run AdamW, and tick a wall clock at every step; the ratio is the median over interleaved rounds
of the per-round ratio of steady-state time per step (median of 10-step blocks). The whole benchmark runs with
deterministic algorithms on (as `deterministic=true` does), so both sides compute the same bits and the final
parameters are compared: flash-attention's backward is not deterministic otherwise.

Stall (`gpt-435m`: 20 layers, d 1280, 435M parameters, 5.2 GB of fp32 parameters + AdamW state, bf16 autocast): each
mode trains in its own process for `--stall-steps` steps with a save every `--interval` steps (file backend,
`keep_latest_k=1`): no checkpoints, sync, async thread, async process. The loop's time runs from the first step to
the final save, after a device sync (so the final save and the drain of the writer are left out). The stall per save
is the extra loop time over the run without checkpoints, divided by the saves made in the loop, where each run's
extra time is what its loop took beyond its own median step times the steps (the step time of a GPU drifts between
processes by more than the stall; the plain difference of loop times is reported too). Target: async stall / sync
stall <= 0.05 (thread and process), and the step time between saves unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import RESULTS_DIR, format_table, format_targets, median, target, write_results
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from perdure import ResumableSampler, Runner, RunnerConfig  # noqa: E402
from perdure.runners.determinism import configure_determinism  # noqa: E402

NAME = "gpu"
SEED = 0
LR = 3e-4
BLOCK = 10
# "-off": ckpt.device_staging=off (straight into pinned host buffers; the default copies on the GPU first if it can)
STALL_MODES = ("none", "disabled", "thread", "process", "thread-off", "process-off")
TARGET_STALL_RATIO = 0.05


# ---- models ------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def mlp_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    inputs, targets = batch
    return F.cross_entropy(model(inputs), targets)


def workload(name: str, smoke: bool) -> dict[str, Any]:
    """Model factory, dataset, loss, batch size and precision of one step-time workload."""
    generator = torch.Generator().manual_seed(1234)
    if name == "mlp":
        width, size = (64, 256) if smoke else (2048, 64 * 256)
        inputs = torch.randn(size, width, generator=generator)
        dataset = TensorDataset(inputs, torch.randint(0, 10, (size,), generator=generator))

        def model() -> nn.Module:
            return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10))  # fmt: skip

        return {"model": model, "dataset": dataset, "loss": mlp_loss, "batch": 64, "precision": "fp32"}
    vocab, length, width, layers, heads, size = (256, 32, 64, 2, 4, 64) if smoke else (8192, 256, 512, 6, 8, 2048)
    tokens = torch.randint(0, vocab, (size, length + 1), generator=generator)
    dataset = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return {"model": lambda: GPT(vocab, length, width, layers, heads), "dataset": dataset, "loss": gpt_loss,
            "batch": 16, "precision": "bf16"}  # fmt: skip


# ---- step time: hand loop and runner -------------------------------------------------------------------------------


class Ticks:
    def __init__(self, device: torch.device) -> None:
        self.device, self.wall = device, []

    def tick(self) -> None:
        self.wall.append(time.perf_counter())

    def per_step(self) -> float:
        ticks = self.wall
        blocks = [(ticks[i + BLOCK] - ticks[i]) / BLOCK for i in range(0, len(ticks) - BLOCK, BLOCK)]
        return median(blocks) if blocks else (ticks[-1] - ticks[0]) / max(len(ticks) - 1, 1)


def hand_loop(spec: dict[str, Any], steps: int, device: torch.device) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(SEED)
    model = spec["model"]().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    dataset = spec["dataset"]
    sampler = ResumableSampler(len(dataset), shuffle=True, seed=SEED)
    loader = StatefulDataLoader(dataset, batch_size=spec["batch"], sampler=sampler, generator=torch.Generator(),
                                pin_memory=device.type == "cuda")  # fmt: skip
    autocast = spec["precision"] == "bf16"
    ticks, step, epoch = Ticks(device), 0, 0
    model.train()
    while step < steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ticks.tick()
            batch = [tensor.to(device, non_blocking=True) for tensor in batch]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = spec["loss"](model, batch)
            loss.backward()
            optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    _synchronize(device)
    return ticks.per_step(), [p.detach().cpu() for p in model.parameters()]


class BenchConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.seed = SEED
        self.steps = 100
        self.ckpt.enabled = False
        self.skip_nonfinite_grad = False  # the hand loop checks nothing either
        self.deterministic = True
        self.log.interval = 10**9


class StepRunner(Runner):
    def __init__(self, config: BenchConfig, spec: dict[str, Any]) -> None:
        super().__init__(config)
        self.spec = spec
        self.model = spec["model"]()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.datasets["train"] = spec["dataset"]
        self.ticks = Ticks(self.device)

    def train_step(self, batch: Any) -> torch.Tensor:
        self.ticks.tick()
        return self.spec["loss"](self.model, self.unpack_batch(batch))


def runner_loop(spec: dict[str, Any], steps: int, root: Path, device: torch.device) -> tuple[float, list]:
    config = BenchConfig()
    config.steps, config.precision = steps, spec["precision"]
    config.dataloader.batch_size = spec["batch"]
    config.dataloader.pin_memory = device.type == "cuda"
    config.workspace.root = str(root)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):  # its console lines
        runner = StepRunner(config, spec)
        runner.train()
    _synchronize(device)
    return runner.ticks.per_step(), [p.detach().cpu() for p in runner.unwrap_model().parameters()]


def measure_steps(names: list[str], rounds: int, smoke: bool, device: torch.device, scratch: Path) -> dict:
    results = {}
    for name in names:
        spec = workload(name, smoke)
        steps = 30 if smoke else (300 if name == "mlp" else 150)
        hand_loop(spec, BLOCK * 2, device)  # warm-up: kernels, allocator, lazy imports
        ratios, hand_times, runner_times, same = [], [], [], True
        for index in range(rounds):
            order = ("hand", "runner") if index % 2 == 0 else ("runner", "hand")
            timed = {}
            for side in order:
                if side == "hand":
                    timed[side] = hand_loop(spec, steps, device)
                else:
                    timed[side] = runner_loop(spec, steps, scratch / f"{name}-{index}", device)
            (hand, hand_params), (run, run_params) = timed["hand"], timed["runner"]
            ratios.append(run / hand)
            hand_times.append(hand)
            runner_times.append(run)
            same = same and all(torch.equal(a, b) for a, b in zip(hand_params, run_params))
        results[name] = {
            "hand_ms_per_step": median(hand_times) * 1e3,
            "runner_ms_per_step": median(runner_times) * 1e3,
            "ratio": median(ratios),
            "ratios": ratios,
            "same_params_as_hand": same,
            "steps": steps,
            "precision": spec["precision"],
        }
        print(f"{name}: runner / hand {median(ratios):.3f} (same params: {same})", flush=True)
    return results


# ---- stall: one mode per process ------------------------------------------------------------------------------------


def timed(record: dict[str, float], name: str, function: Any) -> Any:
    """`function`, adding the seconds each call takes to `record[name]`."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            record[name] = record.get(name, 0.0) + time.perf_counter() - started

    return wrapper


def time_save_phases(runner: StallRunner) -> None:
    """Where a save call's time goes, in the order it spends it: the last saves' outcomes reported, the losses made
    numbers (a device sync), the states gathered, their state dicts, a sync save's commit, room made in the writer's
    queue, the host memory check, the snapshot (buffers taken, copies started), the hand-over, the log line; Python's
    garbage collections meanwhile; `other` is the rest (the config's text, ...). Only in a stall run's own process:
    the patched functions are perdure's, for this measurement."""
    import gc

    import perdure.checkpoints.base as manager_module
    import perdure.runners.checkpoint_binding as binding_module
    from perdure.checkpoints.async_save import AsyncSaver

    phases = runner.phases
    binding = runner.checkpointing
    binding.report_saves = timed(phases, "report", binding.report_saves)  # type: ignore[method-assign]
    binding_module.losses_as_floats = timed(phases, "losses", binding_module.losses_as_floats)
    runner.telemetry.before_checkpoint = timed(phases, "telemetry", runner.telemetry.before_checkpoint)
    runner.checkpoint_states = timed(phases, "states", runner.checkpoint_states)
    binding.tensors_changed_by_step = timed(phases, "states", binding.tensors_changed_by_step)  # type: ignore[method-assign]
    manager = type(runner.checkpoints)  # its class, not the object: the writer process gets a copy of the object
    manager.snapshot_states = timed(phases, "state_dicts", manager.snapshot_states)
    manager._commit_now = timed(phases, "sync_commit", manager._commit_now)
    AsyncSaver.make_room = timed(phases, "make_room", AsyncSaver.make_room)
    manager_module.available_memory = timed(phases, "memory_check", manager_module.available_memory)
    manager_module.Snapshot = timed(phases, "snapshot", manager_module.Snapshot)
    AsyncSaver.submit = timed(phases, "submit", AsyncSaver.submit)
    runner.logger.info = timed(phases, "log", runner.logger.info)
    collecting: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collecting.append(time.perf_counter())
        elif collecting:
            phases["gc"] = phases.get("gc", 0.0) + time.perf_counter() - collecting.pop()

    gc.callbacks.append(on_gc)


class StallRunner(Runner):
    def __init__(self, config: RunnerConfig, smoke: bool) -> None:
        super().__init__(config)
        self.phases: dict[str, float] = {}  # the save call under way: seconds per phase (`time_save_phases`)
        self.save_phases: list[dict[str, float]] = []
        vocab, length, width, layers, heads = (256, 32, 64, 2, 4) if smoke else (32768, 256, 1280, 20, 20)
        self.model = GPT(vocab, length, width, layers, heads)
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (64, length + 1), generator=generator)
        self.datasets["train"] = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
        self.ticks: list[float] = []
        self.loop_end: float | None = None
        self.save_calls: list[float] = []  # seconds the loop spent inside each save call (the snapshot's host side)
        self.pool = None
        self.reserve_started: float | None = None  # when the buffers began to be made, in the background
        self.profile_steps: tuple[int, int] | None = None  # a torch.profiler trace of the steps in [first, last)
        self.profile_path: Path | None = None
        self.profiler: Any = None

    def train_step(self, batch: Any) -> torch.Tensor:
        self.ticks.append(time.perf_counter())
        if self.profile_steps and self.state.global_step == self.profile_steps[0]:
            self.profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU]
                + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            )
            self.profiler.__enter__()
        elif self.profiler is not None and self.state.global_step == self.profile_steps[1]:
            self.profiler.__exit__(None, None, None)
            self.profiler.export_chrome_trace(str(self.profile_path))
            self.profiler = None
        return gpt_loss(self.model, self.unpack_batch(batch))

    def __post_init__(self) -> None:
        super().__post_init__()
        reserve = self.checkpointing.reserve_snapshot_buffers

        def reserve_and_keep_the_pool() -> None:
            if self.reserve_started is None:  # called after every optimizer step; the buffers are made after the first
                self.reserve_started = time.perf_counter()
            reserve()
            if self.pool is None and self.config.ckpt.async_mode != "disabled":
                self.pool = self.checkpoints._async_saver().pool  # kept, to say what its buffers cost

        self.checkpointing.reserve_snapshot_buffers = reserve_and_keep_the_pool  # type: ignore[method-assign]

    def save_checkpoint(self, reason: str) -> Path | None:
        if reason == "final" and self.loop_end is None:
            _synchronize(self.device)
            self.loop_end = time.perf_counter()
        self.phases.clear()
        started = time.perf_counter()
        path = super().save_checkpoint(reason)
        if reason != "final":
            self.save_calls.append(time.perf_counter() - started)
            self.save_phases.append({**self.phases, "other": self.save_calls[-1] - sum(self.phases.values())})
        return path


def stall_mode(mode: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    configure_determinism(False)
    config = RunnerConfig()
    config.steps = args.stall_steps
    config.precision = "bf16"
    config.dataloader.batch_size = 4 if args.smoke else 8
    config.dataloader.pin_memory = torch.cuda.is_available()
    config.ckpt.enabled = mode != "none"
    config.ckpt.async_mode = "disabled" if mode == "none" else mode.removesuffix("-off")
    config.ckpt.device_staging = "off" if mode.endswith("-off") else "auto"
    config.ckpt.interval = args.interval
    config.ckpt.keep_latest_k = 1
    config.log.interval = 10**9
    config.workspace.root = str(root)
    config.workspace.id = mode
    runner = StallRunner(config, args.smoke)
    if args.profile and mode in ("thread", "process"):  # the steps around the second save
        runner.profile_steps = (2 * args.interval - 2, 2 * args.interval + 4)
        runner.profile_path = Path(args.profile) / f"stall-{mode}.json"
        runner.profile_path.parent.mkdir(parents=True, exist_ok=True)
    parameters = sum(p.numel() for p in runner.model.parameters())
    time_save_phases(runner)
    runner.train()
    ticks = runner.ticks
    steps_between = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
    saves_in_loop = 0 if mode == "none" else (args.stall_steps - 1) // args.interval
    typical = median(steps_between)
    # A save after step s lands in the gap after that step; its copies are waited for in the next one.
    save_steps = [args.interval * k for k in range(1, saves_in_loop + 1)]
    stall_each = [sum(gap - typical for gap in steps_between[s - 2 : s + 1]) for s in save_steps]
    # The first save of each set of host buffers (two sets on a GPU) may pay what a run pays once: buffers still being
    # made, a writer process receiving them for the first time. The saves after those show what every later one costs.
    pool = runner.pool
    # What making the buffers in the background cost the steps it overlapped (those around a save excluded).
    reserve_excess = None
    if pool is not None and pool.reserve_seconds is not None and runner.reserve_started is not None:
        window = (runner.reserve_started, runner.reserve_started + pool.reserve_seconds)
        near_save = {i for s in save_steps for i in range(s - 2, s + 1)}
        reserve_excess = sum(gap - typical for i, gap in enumerate(steps_between)
                             if i not in near_save and window[0] <= ticks[i] < window[1])  # fmt: skip
    return {
        "mode": mode,
        # Host buffers made ahead of the saves (and in how long), and made by a save itself (time the loop paid).
        "buffers": None
        if pool is None
        else {
            "reserved_gb": pool.reserved_nbytes / 1e9,
            "reserve_s": pool.reserve_seconds,
            "reserve_excess_s": reserve_excess,
            "on_demand_gb": pool.on_demand_nbytes / 1e9,
            "staged_on_device_gb": pool.staging.staged_on_device_nbytes / 1e9,
        },
        "save_call_s": runner.save_calls,
        "save_phases_s": runner.save_phases,
        # Every step's time, to compare the steps while a writer is busy with those while none is (and with `none`).
        "step_ms": [round(gap * 1e3, 2) for gap in steps_between],
        "loop_s": runner.loop_end - ticks[0],
        "saves_in_loop": saves_in_loop,
        "median_step_s": typical,
        "steady_stall_s": median(stall_each[2:]) if len(stall_each) > 2 else None,
        "stall_each_s": stall_each,
        "parameters": parameters,
        "state_gb": parameters * 4 * 3 / 1e9,
    }


def measure_stall(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    results = {}
    for mode in args.stall_modes:
        command = [sys.executable, __file__, "--stall-mode", mode, "--root", str(scratch / mode),
                   "--stall-steps", str(args.stall_steps), "--interval", str(args.interval),
                   "--device", args.device] + (["--smoke"] if args.smoke else []) \
                  + (["--profile", args.profile] if args.profile else [])  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:  # one device call may be all there is: say why, and measure the other modes
            print(f"stall {mode}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}", flush=True)
            shutil.rmtree(scratch / mode, ignore_errors=True)
            continue
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        shutil.rmtree(scratch / mode, ignore_errors=True)  # ~5 GB per checkpoint of the full-size model
        # The whole result at once: a run cut short by its time limit still says what it measured.
        print(f"stall {mode}: loop {results[mode]['loop_s']:.1f}s {json.dumps(results[mode])}", flush=True)
    baseline = results["none"]
    for mode in results:
        if mode == "none":
            continue
        r = results[mode]
        saves = max(r["saves_in_loop"], 1)
        # Each run's time beyond its own typical step: the GPU's step time drifts between processes (on an H200 the
        # median step of three runs in a row was 57.8, 51.7 and 53.0 ms), which over 271 steps is more than the stall.
        r["stall_per_save_s"] = (_excess(r, args.stall_steps) - _excess(baseline, args.stall_steps)) / saves
        r["loop_stall_per_save_s"] = (r["loop_s"] - baseline["loop_s"]) / saves  # the plain difference, as before
        r["step_time_over_none"] = r["median_step_s"] / baseline["median_step_s"]
    return results


def _excess(run: dict[str, Any], steps: int) -> float:
    return run["loop_s"] - steps * run["median_step_s"]


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, repeats: int = 3) -> dict[str, float]:
    """GB/s of copying 1 GiB from the GPU: into a pinned (registered, as the snapshots pin) and a pageable host buffer,
    and to another GPU buffer (what `device_staging` copies first). The floor under a save's stall on this machine."""
    from perdure.checkpoints.staging import allocate_pinned

    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    targets = {
        "to pinned": allocate_pinned((nbytes,), torch.uint8, False),
        "to pageable": torch.empty(nbytes, dtype=torch.uint8).fill_(0),
        "on the device": torch.empty_like(source),
    }
    rates = {}
    for name, target_buffer in targets.items():
        target_buffer.copy_(source, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            target_buffer.copy_(source, non_blocking=True)
        torch.cuda.synchronize(device)
        rates[name] = nbytes * repeats / (time.perf_counter() - started) / 1e9
    del source, targets
    torch.cuda.empty_cache()
    return rates


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stall-steps", type=int, default=51, help="steps of each stall run")
    parser.add_argument("--interval", type=int, default=10, help="steps between saves in the stall runs")
    parser.add_argument("--skip-steps", action="store_true", help="skip the step-time comparison")
    parser.add_argument("--skip-stall", action="store_true", help="skip the async-stall comparison")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check the code paths, measure nothing")
    parser.add_argument("--profile", help="write torch.profiler traces of the steps around the second async save here")
    parser.add_argument(
        "--stall-modes",
        type=lambda text: text.split(","),
        default=list(STALL_MODES),
        help=f"comma-separated, 'none' and 'disabled' among them (default: {','.join(STALL_MODES)})",
    )
    parser.add_argument("--stall-mode", choices=STALL_MODES, help=argparse.SUPPRESS)  # internal: one stall run
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not {"none", "disabled"} <= set(args.stall_modes) <= set(STALL_MODES):
        parser.error(f"--stall-modes: some of {', '.join(STALL_MODES)}, none and disabled among them")
    if args.stall_mode:
        print(json.dumps(stall_mode(args.stall_mode, args, Path(args.root))))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu: skipped, no CUDA device (torch.cuda.is_available() is False); see benchmarks/README.md")
        write_results(NAME, {"skipped": "no CUDA device"}, {"skipped": "no CUDA device"}, [])
        return 0
    if args.device == "cpu" and not args.smoke:
        parser.error("--device cpu only checks the code paths: add --smoke")
    device = torch.device(args.device)
    configure_determinism(True)  # both sides of the step-time comparison compute the same bits
    RESULTS_DIR.mkdir(exist_ok=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    targets = []
    with tempfile.TemporaryDirectory(dir=RESULTS_DIR) as scratch:
        if not args.skip_steps:
            results["steps"] = measure_steps(["mlp", "gpt"], args.rounds, args.smoke, device, Path(scratch))
            rows = [[name, r["precision"], r["hand_ms_per_step"], r["runner_ms_per_step"], r["ratio"],
                     "yes" if r["same_params_as_hand"] else "NO"] for name, r in results["steps"].items()]  # fmt: skip
            print(format_table(["model", "precision", "hand ms/step", "runner ms/step", "ratio", "same params"], rows))
            for name, r in results["steps"].items():
                targets.append(target(f"runner / hand loop time per step, {name}", r["ratio"], "<=", 1.02))
        if not args.skip_stall:
            if device.type == "cuda":
                results["copy_gb_per_s"] = copies = copy_bandwidth(device)
                print("copies of 1 GiB, GB/s: " + ", ".join(f"{name} {rate:.1f}" for name, rate in copies.items()))
            results["stall"] = stall = measure_stall(args, Path(scratch))
            sync = stall["disabled"]["stall_per_save_s"]
            rows = [[mode, r["saves_in_loop"], r["loop_s"], r.get("stall_per_save_s", ""),
                     r.get("stall_per_save_s", math.nan) / sync if mode not in ("none", "disabled") else "",
                     r.get("step_time_over_none", "")] for mode, r in stall.items()]  # fmt: skip
            print(f"stall model: {stall['none']['parameters'] / 1e6:.0f}M parameters, "
                  f"{stall['none']['state_gb']:.1f} GB of parameters + AdamW state")  # fmt: skip
            print(format_table(["mode", "saves", "loop s", "stall/save s", "x sync", "step time / none"], rows))
            for mode in (mode for mode in STALL_MODES[1:] if mode in stall):
                each = ", ".join(f"{seconds:.2f}" for seconds in stall[mode]["stall_each_s"])
                print(f"{mode}: steps around each save took longer by {each} s (after the first two: "
                      f"{stall[mode]['steady_stall_s']} s)")  # fmt: skip
                for call, phases in zip(stall[mode]["save_call_s"], stall[mode]["save_phases_s"]):
                    spent = ", ".join(
                        f"{name} {seconds * 1e3:.0f}" for name, seconds in phases.items() if seconds > 0.002
                    )
                    print(f"  save call {call * 1e3:.0f} ms: {spent}")
                if stall[mode]["buffers"] is not None:
                    print(f"{mode}: snapshot buffers {stall[mode]['buffers']}")
            for mode in (mode for mode in STALL_MODES[2:] if mode in stall):
                ratio = stall[mode]["stall_per_save_s"] / sync
                if stall[mode]["steady_stall_s"] is not None:
                    print(f"async {mode} steady stall / sync save stall: {stall[mode]['steady_stall_s'] / sync:.3f}")
                if mode.endswith("-off"):  # the staging without a device copy: for comparison, not a target
                    print(f"async {mode} stall / sync save stall: {ratio:.3f}")
                else:
                    targets.append(target(f"async {mode} stall / sync save stall", ratio, "<=", TARGET_STALL_RATIO))
    print(format_targets(targets))
    config = {"rounds": args.rounds, "stall_steps": args.stall_steps, "interval": args.interval,
              "device": args.device, "smoke": args.smoke, "deterministic": True}  # fmt: skip
    if args.smoke:
        print("smoke run: code paths checked, nothing measured (results not written)")
        return 0
    print(f"results: {write_results(NAME, config, results, targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
