"""Shared helpers of the benchmarks: thread setup, statistics, the results table and `bench-results/<name>.json`.

Benchmarks are measurements with a baseline taken in the same process and run, never timed tests: each one reports
ratios against its baseline and whether the target was met, and `run.py` never fails because a target was missed
(only `--strict` makes it).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench-results"
DEFAULT_THREADS = 1


def setup_threads() -> int:
    """Pin torch's intra-op threads to `OMP_NUM_THREADS` (default 1) so both sides of a comparison get the same."""
    threads = int(os.environ.get("OMP_NUM_THREADS") or DEFAULT_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    return threads


def load_note() -> str | None:
    """A warning when other work loads this machine's CPUs enough to distort wall-clock timings, else None."""
    if not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load <= cpus:  # this benchmark itself accounts for ~1
        return None
    return (
        f"load average {load:.1f} on {cpus} CPUs: other processes compete with this benchmark, so wall-clock "
        "numbers are inflated and noisy; compare the CPU-time columns or rerun on a quieter machine"
    )


LOAD_AT_START = os.getloadavg() if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average_at_start": LOAD_AT_START,
        "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def spread(values: Sequence[float]) -> str:
    """`min..max` of a sample, for the table."""
    return f"{min(values):.4g}..{max(values):.4g}"


def target(metric: str, value: float, op: str, bound: float) -> dict[str, Any]:
    """A target record: `value op bound` (op is `<=` or `>=`)."""
    met = value <= bound if op == "<=" else value >= bound
    return {"metric": metric, "value": value, "op": op, "bound": bound, "met": bool(met)}


def write_results(name: str, config: dict[str, Any], results: dict[str, Any], targets: list[dict[str, Any]]) -> Path:
    """Write `bench-results/<name>.json` and return its path."""
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    record = {
        "name": name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine_info(),
        "config": config,
        "results": results,
        "targets": targets,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table with aligned columns (numbers right-aligned)."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [
        max(len(str(h)), *(len(row[i]) for row in cells)) if cells else len(str(h)) for i, h in enumerate(headers)
    ]
    numeric = [all(_is_number(row[i]) for row in rows) and bool(rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line([str(h) for h in headers]), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def format_targets(targets: Sequence[dict[str, Any]]) -> str:
    lines = []
    for t in targets:
        verdict = "met" if t["met"] else "MISSED"
        lines.append(f"target {t['metric']} {t['op']} {t['bound']}: {t['value']:.4g} -> {verdict}")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class SteadyProfile:
    """cProfile of a loop's steady state: `tick()` at the start of every step enables it at the first step after
    `warmup` steps (compilation, the first allocations and lazy imports left out); `stop()` after the loop."""

    def __init__(self, warmup: int) -> None:
        import cProfile

        self.profiler = cProfile.Profile()
        self.warmup, self.steps = warmup, 0

    def tick(self) -> None:
        self.steps += 1
        if self.steps == self.warmup + 1:
            self.profiler.enable()

    def stop(self) -> int:
        """Disable it; returns the number of steps profiled."""
        self.profiler.disable()
        return max(self.steps - self.warmup, 0)


def _by_function(profiler: Any) -> dict[str, tuple[int, float, float]]:
    """(calls, own seconds, cumulative seconds) per `path:function`, paths short (site-packages and the repo cut)."""
    import pstats

    table: dict[str, tuple[int, float, float]] = {}
    for (path, _, function), (_, calls, own, cumulative, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        name = f"{path.split('site-packages/')[-1].replace(str(REPO) + '/', '')}:{function}"
        before = table.get(name, (0, 0.0, 0.0))
        table[name] = (before[0] + calls, before[1] + own, before[2] + cumulative)
    return table


def profile_difference(hand: Any, hand_steps: int, runner: Any, runner_steps: int, rows: int = 20) -> str:
    """The functions whose own time per step (cProfile's, so inflated alike on both sides) differs most between the
    runner's steady state and the hand loop's, with their calls per step on each side: perdure's own calls show with
    no hand-loop calls, an engine or collective call that got slower shows with the same calls on both."""
    mine, theirs = _by_function(runner), _by_function(hand)
    lines = []
    for name in set(mine) | set(theirs):
        r_calls, r_own, r_cum = mine.get(name, (0, 0.0, 0.0))
        h_calls, h_own, _ = theirs.get(name, (0, 0.0, 0.0))
        own = r_own / runner_steps - h_own / hand_steps
        lines.append([name, h_calls / hand_steps, r_calls / runner_steps, h_own / hand_steps * 1e3,
                      r_own / runner_steps * 1e3, own * 1e3, r_cum / runner_steps * 1e3])  # fmt: skip
    lines.sort(key=lambda line: -abs(line[5]))
    extra = sum(line[5] for line in lines)
    table = format_table(["function", "hand calls/step", "runner calls/step", "hand own ms/step", "runner own ms/step",
                          "extra own ms/step", "runner cumulative ms/step"], lines[:rows])  # fmt: skip
    return f"{table}\nall functions: the runner's own time exceeds the hand loop's by {extra:.3f} ms per step"
