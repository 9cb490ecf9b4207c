"""Step overhead: TorchRunner against a hand-written loop doing the same math.

Both sides train the same 3-layer MLP (width 256, batch 64, AdamW) on the same synthetic in-memory TensorDataset,
read through the same data path: torchdata's `StatefulDataLoader` with perdure's `ResumableSampler` (torch's own
`RandomSampler` draws an extra `randperm` per epoch, so it would not be the same math). The runner side has
checkpoints disabled (`ckpt.enabled=false`) and no validation split, so only the per-step cost of the training loop
is compared. Both loops read a wall and a CPU clock at the start of every step's forward: the ratio is the
steady-state time per step (data loading included; the median over blocks of 50 steps, each holding one of the
runner's log lines), and what `train()` spends before the first and after the last step is reported apart as the
runner's start + finish cost. Rounds are interleaved (the order alternates) and the
median of the per-round ratios is reported, in wall-clock time (the target's) and in process CPU time (immune to
preemption by other processes, but blind to time spent blocked in I/O such as an fsync). Every round also checks
that both sides end with bit-identical parameters, which is what makes the timing a comparison of the same math. A
probe run then times, inside the runner's loop, each call the hand loop does not make, to show where the
difference goes.

Variants:
  hand         the baseline: zero_grad, forward, loss, backward, step -- nothing else
  runner       TorchRunner with its default config (non-finite gradient check on, a log line every 50 steps)
  runner-lean  TorchRunner with `skip_nonfinite_grad=false` and one log line at the end: the framework's own cost
  (--ablate also: the runner with one part taken out, in turn; and hand-checked, the hand loop with the runner's
  non-finite check written into it)

    python benchmarks/step_overhead.py [--steps 2000] [--rounds 5]
    python benchmarks/step_overhead.py --breakdown   # where the runner's extra time per step goes
    python benchmarks/step_overhead.py --profile     # cProfile of the runner (bench-results/step_overhead.prof)
    python benchmarks/step_overhead.py --ablate      # each part's cost in the loop: the runner without it, in turn
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from _common import format_table, format_targets, load_note, median, setup_threads, spread, target, write_results
from _telemetry_cost import goodput_and_straggler_target
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from perdure import ResumableSampler, Runner, RunnerConfig

NAME = "step_overhead"
FEATURES = 256
WIDTH = 256
CLASSES = 10
BATCH = 64
BATCHES_PER_EPOCH = 250  # 2000 steps cross 7 epoch boundaries: the per-epoch reshuffle is part of both loops
SEED = 0
LR = 1e-3
TARGET_RATIO = 1.02
VARIANTS = ("hand", "runner", "runner-lean")
BLOCK = RunnerConfig().log.interval  # steps per timing block: the runner's default log interval (50)


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    size = BATCH * BATCHES_PER_EPOCH
    inputs = torch.randn(size, FEATURES, generator=generator)
    targets = torch.randint(0, CLASSES, (size,), generator=generator)
    return TensorDataset(inputs, targets)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES)
    )


class StepClock:
    """Wall and CPU clocks read at the start of every step's forward, on both sides alike.

    `per_step` is the median over consecutive blocks of `BLOCK` steps of the block's time per step: a block holds
    exactly one of the runner's periodic log lines (`BLOCK` is the default `log.interval`), so the estimate includes
    that cost, while a block in which the machine preempted this process does not move the median. What `train()`
    spends outside the ticks (start and finish) is the per-run fixed cost.
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def per_step(self) -> tuple[float, float]:
        """(wall, cpu) seconds per step in the steady state."""
        return _block_median(self.wall), _block_median(self.cpu)

    def span(self) -> float:
        """Wall seconds from the first tick to the last."""
        return self.wall[-1] - self.wall[0] if self.wall else 0.0


def _block_median(ticks: list[float]) -> float:
    blocks = [(ticks[i + BLOCK] - ticks[i]) / BLOCK for i in range(0, len(ticks) - BLOCK, BLOCK)]
    if not blocks:
        return (ticks[-1] - ticks[0]) / max(len(ticks) - 1, 1)
    return median(blocks)


@dataclass
class Timing:
    total_wall: float  # the whole loop: `runner.train()`, or the hand loop from its first line to its last
    total_cpu: float
    step_wall: float  # steady state, per step (see StepClock)
    step_cpu: float
    fixed_wall: float  # total minus the span of the ticks and the one step after the last tick
    params: list[torch.Tensor]

    @classmethod
    def of(cls, wall: float, cpu: float, clock: StepClock, model: nn.Module) -> Timing:
        step_wall, step_cpu = clock.per_step()
        fixed = wall - clock.span() - step_wall
        return cls(wall, cpu, step_wall, step_cpu, fixed, [p.detach().clone() for p in model.parameters()])


# ---- the baseline --------------------------------------------------------------------------------------------


def hand_loop(dataset: TensorDataset, steps: int, checked: bool = False) -> Timing:
    """What a user writes by hand over the same loader and sampler; `checked` adds, by hand, what the runner's default
    non-finite check does (GradScaler's fused kernel at scale 1, one `.item()`, the step skipped on an inf or NaN)."""
    torch.manual_seed(SEED)
    model = make_model()
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    sampler = ResumableSampler(len(dataset), shuffle=True, seed=SEED)
    loader = StatefulDataLoader(dataset, batch_size=BATCH, sampler=sampler, generator=torch.Generator())
    clock = StepClock()
    parameters, found, unit = list(model.parameters()), torch.zeros(1), torch.ones(1)
    model.train()
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    step = epoch = 0
    while step < steps:
        sampler.set_epoch(epoch)
        for inputs, labels in loader:
            clock.tick()
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(model(inputs), labels)
            loss.backward()
            if checked:
                torch._amp_foreach_non_finite_check_and_unscale_([p.grad for p in parameters], found, unit)
            if not checked or not found.item():
                optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return Timing.of(wall, cpu, clock, model)


# ---- the runner ----------------------------------------------------------------------------------------------


class BenchConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.seed = SEED
        self.steps = 2000
        self.dataloader.batch_size = BATCH
        self.ckpt.enabled = False


class MLPRunner(Runner):
    def __init__(self, config: BenchConfig, dataset: TensorDataset | None = None) -> None:
        super().__init__(config)
        self.model = make_model()
        self.criterion = nn.CrossEntropyLoss()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.datasets["train"] = dataset
        self.clock = StepClock()

    def train_step(self, batch: Any) -> torch.Tensor:
        self.clock.tick()
        return super().train_step(batch)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The runner's console lines go to /dev/null (its log file is still written, as in a real run)."""
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


# ---- ablations (--ablate): the default runner with one part of its per-step work taken out ----------------------
# Measurement only: an ablated runner trains the same math (the same final parameters as the hand loop, checked every
# round) but is not a configuration anyone should run; several reach into the runner's internals to take a part out.


def _without_check(config: BenchConfig) -> None:
    config.skip_nonfinite_grad = False


def _without_log_lines(config: BenchConfig) -> None:
    config.log.interval = config.steps  # one line, at the end


def _without_hang_watch(config: BenchConfig) -> None:
    config.dist.step_timeout = 0  # no watch thread, no phase marks around each batch


def _without_telemetry_step(runner: MLPRunner) -> None:
    runner.telemetry.step = lambda step: None  # type: ignore[method-assign]  # heartbeat, goodput clock, progress


def _without_straggler_timing(runner: MLPRunner) -> None:
    runner.stragglers.timing = contextlib.nullcontext  # type: ignore[method-assign]


def _bare_loop(runner: MLPRunner) -> None:
    """The runner's model, optimizer, loader and `train_step`, stepped by a loop that does nothing else."""

    def train_until(done: Any, budget: str) -> None:
        loader, optimizer = runner.dataloaders["train"], runner.optimizer
        optimizer.zero_grad(set_to_none=True)
        while runner.state.global_step < runner.config.steps:
            for batch in loader.iter_epoch(runner.state.epoch):
                runner.train_step(batch).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                runner.state.global_step += 1
                if runner.state.global_step == runner.config.steps:
                    break
            runner.state.epoch += 1

    runner._train_until = train_until  # type: ignore[method-assign]


# name: (a config change before the runner is built, a patch of the built runner); `control` takes nothing out: its
# "cost" is the table's noise, what two identical runners differ by in the same rounds
ABLATIONS: dict[str, tuple[Any, Any]] = {
    "control": (None, None),
    "no-check": (_without_check, None),
    "no-log-lines": (_without_log_lines, None),
    "no-hang-watch": (_without_hang_watch, None),
    "no-telemetry-step": (None, _without_telemetry_step),
    "no-straggler-timing": (None, _without_straggler_timing),
    "bare-loop": (None, _bare_loop),
}


def build_runner(dataset: TensorDataset, steps: int, root: Path, variant: str) -> MLPRunner:
    root.mkdir(parents=True)
    os.environ["PERDURE_ROOT"] = str(root)  # the environment wins over workspace.root: set both
    config = BenchConfig()
    config.steps = steps
    config.workspace.root = str(root)
    if variant == "runner-lean":
        config.skip_nonfinite_grad = False
        config.log.interval = steps
    change, patch = ABLATIONS.get(variant.removeprefix("runner-"), (None, None))
    if change is not None:
        change(config)
    with quiet():
        runner = MLPRunner(config, dataset=dataset)
    if patch is not None:
        patch(runner)
    return runner


def detach_log_files(root: Path) -> None:
    """Close the run log file a finished runner under `root` left on the process-wide `perdure` logger.

    The runner replaces it when the next runner starts; closing it here keeps a finished round's file handle and
    handler out of the next round's timing either way.
    """
    logger = logging.getLogger("perdure")
    for handler in list(logger.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(root):
            logger.removeHandler(handler)
            handler.close()


def runner_loop(dataset: TensorDataset, steps: int, root: Path, variant: str) -> Timing:
    runner = build_runner(dataset, steps, root, variant)
    gc.collect()
    with quiet():
        wall, cpu = time.perf_counter(), time.process_time()
        runner.train()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    detach_log_files(root)
    return Timing.of(wall, cpu, runner.clock, runner.unwrap_model())


# ---- measurement ---------------------------------------------------------------------------------------------


def run_variant(variant: str, dataset: TensorDataset, steps: int, workdir: Path, tag: str) -> Timing:
    if variant in ("hand", "hand-checked"):
        return hand_loop(dataset, steps, checked=variant == "hand-checked")
    return runner_loop(dataset, steps, workdir / f"{variant}-{tag}", variant)


def same_params(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def measure(steps: int, rounds: int, warmup_steps: int, variants: tuple[str, ...] = VARIANTS) -> dict[str, Any]:
    dataset = make_dataset()
    per_round: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
    with tempfile.TemporaryDirectory(prefix="perdure-bench-") as tmp:
        workdir = Path(tmp)
        for variant in variants:  # warm up allocator, caches and lazy imports on both sides
            run_variant(variant, dataset, warmup_steps, workdir, "warmup")
        for index in range(rounds):
            order = variants if index % 2 == 0 else variants[::-1]
            timings = {variant: run_variant(variant, dataset, steps, workdir, str(index)) for variant in order}
            hand = timings["hand"]
            for variant, timing in timings.items():
                per_round[variant].append(
                    {
                        "us_per_step": timing.step_wall * 1e6,
                        "cpu_us_per_step": timing.step_cpu * 1e6,
                        "ratio": timing.step_wall / hand.step_wall,
                        "extra_us_per_step": (timing.step_wall - hand.step_wall) * 1e6,
                        "cpu_ratio": timing.step_cpu / hand.step_cpu,
                        "total_ratio": timing.total_wall / hand.total_wall,
                        "fixed_ms": timing.fixed_wall * 1e3,
                        "same_params_as_hand": same_params(timing.params, hand.params),
                    }
                )
            line = "  ".join(f"{v} {timings[v].step_wall * 1e6:.0f}us" for v in variants)
            print(f"round {index + 1}/{rounds} (per step): {line}", flush=True)
    summary: dict[str, Any] = {}
    for variant, records in per_round.items():
        ratios = [r["ratio"] for r in records]
        summary[variant] = {
            **{key: median(r[key] for r in records) for key in records[0] if key != "same_params_as_hand"},
            "ratio_range": [min(ratios), max(ratios)],
            "same_params_as_hand": all(r["same_params_as_hand"] for r in records),
            "rounds": records,
        }
    return summary


class Probe:
    """Wraps `owner.attr` to time every call, keyed by the file it was called from (or only calls from `caller`)."""

    def __init__(self, label: str, owner: Any, attr: str, caller: str | None = None) -> None:
        self.label, self.owner, self.attr = label, owner, attr
        self.original = getattr(owner, attr)
        self.had_own = attr in vars(owner)
        self.samples: dict[str, list[float]] = {}
        original, samples, clock = self.original, self.samples, time.perf_counter

        def probe(*args: Any, **kwargs: Any) -> Any:
            where = sys._getframe(1).f_code.co_filename
            if caller is not None and not where.endswith(caller):
                return original(*args, **kwargs)
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                samples.setdefault(Path(where).name, []).append(clock() - start)

        setattr(owner, attr, probe)

    def remove(self) -> None:
        if self.had_own:
            setattr(self.owner, self.attr, self.original)
        else:
            delattr(self.owner, self.attr)


def breakdown(steps: int) -> list[list[Any]]:
    """Time, inside a default-config runner's loop, each call the hand loop does not make (plus two it shares).

    Medians per call are used, so a preempted call does not inflate the estimate; nested calls are listed under
    their parent (`_end_step` includes `_log_train_progress` and `save_checkpoint`). Inline expressions of
    `_train_window` (`loss / len(window)`, the `with` blocks) cannot be probed and are not listed.
    """
    dataset = make_dataset()
    base = "perdure/runners/base.py"
    losses = "perdure/runners/losses.py"
    with tempfile.TemporaryDirectory(prefix="perdure-bench-") as tmp:
        runner_loop(dataset, 200, Path(tmp) / "warmup", "runner")
        runner = build_runner(dataset, steps, Path(tmp) / "probed", "runner")
        loader = runner.dataloaders["train"]
        # (label, object, attribute, only calls from this file); objects the runner does not have are skipped
        targets: list[tuple[str, Any, str, str | None]] = [
            ("optimizer.step (also in the hand loop)", runner.optimizer, "step", None),
            ("runner.backward (loss.backward is in the hand loop)", runner, "backward", None),
            ("optimizer.zero_grad (the hand loop makes 1 per step)", runner.optimizer, "zero_grad", None),
            ("torch.nn.utils.get_total_norm (finite check)", torch.nn.utils, "get_total_norm", None),
            ("torch.isfinite (finite check)", torch, "isfinite", None),
            ("torch.stack called in losses.py (log line)", torch, "stack", losses),
            ("Tensor.mean called in losses.py (log line)", torch.Tensor, "mean", losses),
            ("Tensor.__truediv__ called in base.py (forward only)", torch.Tensor, "__truediv__", base),
            ("runner.no_sync", runner, "no_sync", None),
            ("runner.autocast", runner, "autocast", None),
            ("runner.unpack_batch (incl. to_device)", runner, "unpack_batch", None),
            ("loader.batches_in_epoch", loader, "batches_in_epoch", None),
            ("checkpoints.wait_for_snapshots", getattr(runner, "checkpoints", None), "wait_for_snapshots", None),
            ("telemetry.step", getattr(runner, "telemetry", None), "step", None),
            ("runner._end_step", runner, "_end_step", None),
            ("  _end_step -> _log_train_progress", runner, "_log_train_progress", None),
            (
                "    _log_train_progress -> telemetry.log_metrics",
                getattr(runner, "telemetry", None),
                "log_metrics",
                None,
            ),
            ("    _log_train_progress -> telemetry.flush", getattr(runner, "telemetry", None), "flush", None),
            ("  _end_step -> save_checkpoint (ckpt disabled)", runner, "save_checkpoint", None),
        ]
        probes = [
            Probe(label, owner, attr, caller)
            for label, owner, attr, caller in targets
            if owner is not None and callable(getattr(owner, attr, None))
        ]
        try:
            with quiet():
                runner.train()
        finally:
            for probe in reversed(probes):
                probe.remove()
        detach_log_files(Path(tmp))
    rows = []
    for probe in probes:
        if not probe.samples:
            rows.append([probe.label, 0, "", ""])
        for where, samples in probe.samples.items():
            label = probe.label if len(probe.samples) == 1 else f"{probe.label}, from {where}"
            per_call = median(samples) * 1e6
            rows.append([label, len(samples) / steps, per_call, per_call * len(samples) / steps])
    return rows


def profile_runner(steps: int) -> Path:
    """cProfile one default-config runner training; print where its time goes, keep the stats file."""
    import cProfile
    import pstats

    dataset = make_dataset()
    with tempfile.TemporaryDirectory(prefix="perdure-bench-") as tmp:
        runner_loop(dataset, 200, Path(tmp) / "warmup", "runner")
        runner = build_runner(dataset, steps, Path(tmp) / "profiled", "runner")
        profiler = cProfile.Profile()
        with quiet():
            profiler.enable()
            runner.train()
            profiler.disable()
        detach_log_files(Path(tmp))
    path = Path(__file__).resolve().parent.parent / "bench-results" / f"{NAME}.prof"
    path.parent.mkdir(exist_ok=True)
    profiler.dump_stats(path)
    stats = pstats.Stats(profiler)
    print(f"cProfile of {steps} runner steps (inflates small calls; read the runner's own frames):")
    stats.sort_stats("cumulative").print_stats(r"perdure", 25)
    stats.sort_stats("tottime").print_stats(15)
    return path


def ablation_table(steps: int, rounds: int, warmup_steps: int) -> list[list[Any]]:
    """The default runner against itself with each part of `ABLATIONS` taken out, interleaved with the hand loop: a
    part's cost is the runner's extra time per step minus the ablated runner's, measured in the loop (a part's cost
    there is several times its cost called alone, once the step's kernels have evicted the caches). And the hand loop
    with the same non-finite check added by hand: what the check's work costs a loop that does nothing else."""
    ablated = tuple(f"runner-{name}" for name in ABLATIONS)
    summary = measure(steps, rounds, warmup_steps, ("hand", "runner", *ablated, "hand-checked"))
    extra = summary["runner"]["extra_us_per_step"]  # medians over rounds of the difference within a round
    rows = [["runner (defaults)", summary["runner"]["us_per_step"], extra, "", summary["runner"]["ratio"], "yes"]]
    for variant in ablated:
        record = summary[variant]
        ablated_extra = record["extra_us_per_step"]
        rows.append([variant, record["us_per_step"], ablated_extra, extra - ablated_extra, record["ratio"],
                     "yes" if record["same_params_as_hand"] else "NO"])  # fmt: skip
    record = summary["hand-checked"]  # its part's cost is its extra: the hand loop around it does nothing else
    rows.append(["hand-checked", record["us_per_step"], record["extra_us_per_step"], record["extra_us_per_step"],
                 record["ratio"], "yes" if record["same_params_as_hand"] else "NO"])  # fmt: skip
    return rows


SCALE_WIDTHS = (256, 512, 1024)  # 0.13M, 0.40M, 1.33M parameters: the same batch, features and depth


def scale_sweep(steps: int, rounds: int, warmup_steps: int) -> list[list[Any]]:
    """The comparison at each width of `SCALE_WIDTHS`: the runner's extra time per step (wall and CPU) must not grow
    with the parameter count."""
    global WIDTH
    rows = []
    for width in SCALE_WIDTHS:
        WIDTH = width
        parameters = sum(p.numel() for p in make_model().parameters())
        summary = measure(steps, rounds, warmup_steps)
        hand, runner = summary["hand"], summary["runner"]
        rows.append([f"{parameters / 1e6:.2f}M", hand["us_per_step"], runner["us_per_step"] - hand["us_per_step"],
                     runner["cpu_us_per_step"] - hand["cpu_us_per_step"], runner["ratio"], runner["cpu_ratio"],
                     "yes" if runner["same_params_as_hand"] else "NO"])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per timed run")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="cProfile the runner instead of comparing")
    parser.add_argument("--breakdown", action="store_true", help="only time the runner's extra calls in its loop")
    parser.add_argument("--scale", action="store_true", help="the runner's extra time per step at 3 model widths")
    parser.add_argument("--ablate", action="store_true", help="each part's cost, taken out of the runner in turn")
    args = parser.parse_args(argv)
    threads = setup_threads()
    if args.ablate:
        rows = ablation_table(args.steps, args.rounds, args.warmup_steps)
        print(format_table(["variant", "us/step", "extra us/step over hand", "the part's cost us/step", "ratio",
                            "same params"], rows))  # fmt: skip
        return 0
    if args.scale:
        rows = scale_sweep(args.steps, args.rounds, args.warmup_steps)
        print(format_table(["parameters", "hand us/step", "runner extra us/step", "runner extra cpu us/step",
                            "ratio", "cpu ratio", "same params"], rows))  # fmt: skip
        return 0
    if args.profile:
        print(f"profile written to {profile_runner(args.steps)}")
        return 0
    breakdown_headers = ["call", "calls/step", "us/call", "us/step"]
    if args.breakdown:
        print(f"in-loop cost of the runner's calls over {args.steps} steps (median per call):")
        print(format_table(breakdown_headers, breakdown(args.steps)))
        return 0

    print(f"{NAME}: {args.rounds} rounds x {args.steps} steps per variant, torch threads {threads}", flush=True)
    summary = measure(args.steps, args.rounds, args.warmup_steps)
    rows = []
    for variant, s in summary.items():
        same = "baseline" if variant == "hand" else ("yes" if s["same_params_as_hand"] else "NO")
        rows.append([variant, s["us_per_step"], s["ratio"], spread(s["ratio_range"]), s["cpu_us_per_step"],
                     s["cpu_ratio"], s["fixed_ms"], s["total_ratio"], same])  # fmt: skip
    headers = ["variant", "us/step", "ratio", "ratio range", "cpu us/step", "cpu ratio", "start+finish ms",
               f"ratio over {args.steps} steps", "same params"]  # fmt: skip
    print(format_table(headers, rows))
    runner = summary["runner"]
    targets = [target("runner time / hand loop time per step", runner["ratio"], "<=", TARGET_RATIO)]
    for variant in ("runner", "runner-lean"):
        if not summary[variant]["same_params_as_hand"]:
            print(f"WARNING: {variant} did not end with the hand loop's parameters: not the same math, see README")
    print(format_targets(targets))
    rows = breakdown(args.steps)
    print(f"where the runner's time goes: in-loop cost of its calls over {args.steps} steps (median per call)")
    print(format_table(breakdown_headers, rows))
    summary["breakdown"] = [dict(zip(breakdown_headers, row)) for row in rows]
    cost = goodput_and_straggler_target(runner["us_per_step"], BLOCK)
    summary["goodput_and_stragglers"] = cost
    print(
        f"goodput clock + heartbeat step + straggler watch: {cost['us_per_step']:.2f} us/step ("
        + ", ".join(f"{label} {us:.2f} us" for label, us in cost["calls_us"].items())
        + "; on 2 gloo ranks "
        + ", ".join(f"{label} {us:.1f} us" for label, us in cost["collective_us"].items())
        + f", +{cost['extra_collective_us_per_log_line']:.1f} us every {BLOCK} steps) = "
        f"{100 * cost['share_of_step']:.2f}% of the runner's step"
    )
    targets.append(target("goodput + stragglers cost / runner step", cost["share_of_step"], "<=", 0.01))
    print(format_targets(targets[-1:]))
    config = {
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup_steps": args.warmup_steps,
        "model": f"MLP {FEATURES}-{WIDTH}-{WIDTH}-{CLASSES}",
        "batch_size": BATCH,
        "dataset_size": BATCH * BATCHES_PER_EPOCH,
        "optimizer": f"AdamW(lr={LR})",
        "loader": "torchdata StatefulDataLoader + perdure ResumableSampler, num_workers=0",
        "torch_threads": threads,
        "ratio": "median over rounds of (variant / hand) steady-state time per step in the same round, wall clock; "
        "cpu ratio: the same in process CPU time (immune to preemption, blind to time blocked in I/O); "
        "start+finish: train() wall time outside the steady-state steps",
    }
    if note := load_note():
        print(f"WARNING: {note}")
    path = write_results(NAME, config, summary, targets)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
