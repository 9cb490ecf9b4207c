"""Run the benchmarks (`make bench`): each in its own process, then one summary table.

    python benchmarks/run.py [step_overhead] [save_throughput] [async_stall] [writer_handover] [dcp_save]
                             [ddp_step] [parallel_step] [deepspeed_step] [sampler_scale] [gpu] [ft_recovery]
                             [mirror] [model_memory] [--strict]

Each benchmark prints its own table and writes `bench-results/<name>.json`; `gpu` says it skipped where there is no
CUDA device. A missed target is reported, not
failed: this exits non-zero only when a benchmark crashes, or with `--strict` when a target is missed.
`OMP_NUM_THREADS` (default 1) is passed to every benchmark, which pins torch's threads to it for both sides of
each comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_THREADS, RESULTS_DIR, format_table

HERE = Path(__file__).resolve().parent
BENCHMARKS = (
    "step_overhead",
    "save_throughput",
    "async_stall",
    "writer_handover",
    "dcp_save",
    "ddp_step",
    "parallel_step",
    "deepspeed_step",
    "sampler_scale",
    "gpu",
    "ft_recovery",
    "mirror",
    "model_memory",
)


def summary_rows(name: str, record: dict[str, Any]) -> list[list[Any]]:
    results = record["results"]
    if name == "step_overhead":
        hand, runner, lean = results["hand"], results["runner"], results["runner-lean"]
        same = runner["same_params_as_hand"] and lean["same_params_as_hand"]
        return [
            [name, "hand loop, us/step", f"{hand['us_per_step']:.0f}", "", ""],
            [name, "runner, us/step", f"{runner['us_per_step']:.0f}", "", ""],
            [name, "runner / hand in CPU time", f"{runner['cpu_ratio']:.3f}", "", ""],
            [name, "runner-lean / hand (no finite check, no logging)", f"{lean['ratio']:.3f}", "", ""],
            [name, "runner start + finish, ms (hand loop: ~0)", f"{runner['fixed_ms']:.0f}", "", ""],
            [
                name,
                "same final parameters as the hand loop",
                "yes" if same else "NO",
                "yes",
                "met" if same else "MISSED",
            ],
        ]
    if name == "save_throughput":
        speed = results["gb_per_s"]
        return [
            [name, "perdure save GB/s", f"{speed['perdure']:.3f}", "", ""],
            [name, "torch.save + fsync GB/s", f"{speed['torch.save']:.3f}", "", ""],
            [name, "dd conv=fsync GB/s", f"{speed['dd']:.3f}", "", ""],
            [name, "perdure / dd", f"{results['perdure_over_dd']:.3f}", "", ""],
            [name, "perdure with zip crc32 off, GB/s", f"{speed['perdure, no zip crc32']:.3f}", "", ""],
            [name, "deep verify, warm cache, s", f"{results['verify_warm_seconds']:.3f}", "", ""],
            [name, "deep verify, cold cache, s", f"{results['verify_cold_seconds']:.3f}", "", ""],
        ]
    if name == "dcp_save":
        return [
            [name, f"{key}: blocked s / committed s", f"{r['blocked_median_s']:.2f} / {r['committed_median_s']:.2f}",
             "", ""]
            for key, r in results.items()
        ]  # fmt: skip
    if name == "ddp_step":
        return [
            [name, f"{key}: plain / fixed ms per step, same layout", f"{r['plain_ms_per_step']:.2f} / "
             f"{r['fixed_ms_per_step']:.2f}, {'yes' if r['same_layout_as_plain_after_rebuild'] else 'NO'}", "", ""]
            for key, r in results.items()
        ]  # fmt: skip
    if name == "deepspeed_step":
        rows = [[name, f"{key}: hand / runner ms per step, same weights", f"{r['hand_ms_per_step']:.2f} / "
                 f"{r['runner_ms_per_step']:.2f}, {'yes' if r['same_weights_as_hand'] else 'NO'}", "", ""]
                for key, r in results["steps"].items()]  # fmt: skip
        saves = results["saves"]
        rows.append([name, "save s: engine.save_checkpoint / perdure", f"{saves['engine_median_s']:.3f} / "
                     f"{saves['perdure_median_s']:.3f}", "", ""])  # fmt: skip
        return rows
    if name == "parallel_step":
        save = results["dcp_save"]
        return [
            [name, "hand FSDP2 loop / runner / runner-lean, ms per step", f"{results['hand']['ms_per_step']:.1f} / "
             f"{results['runner']['ms_per_step']:.1f} / {results['runner-lean']['ms_per_step']:.1f}", "", ""],
            [name, "runner / hand in CPU time", f"{results['runner']['cpu_ratio']:.3f}", "", ""],
            [name, "DCP save s: sharded (parallel) / replicated (torch)", f"{save['parallel_s']:.2f} / "
             f"{save['torch_s']:.2f} (wall ratio {save['ratio']:.2f})", "", ""],
        ]  # fmt: skip
    if name == "gpu":
        if "skipped" in results:
            return [[name, "skipped", results["skipped"], "", ""]]
        rows = [[name, f"{model}: hand / runner ms per step, same params", f"{r['hand_ms_per_step']:.2f} / "
                 f"{r['runner_ms_per_step']:.2f}, {'yes' if r['same_params_as_hand'] else 'NO'}", "", ""]
                for model, r in results.get("steps", {}).items()]  # fmt: skip
        rows += [[name, f"stall {mode}: per save s, step time / none", f"{r['stall_per_save_s']:.3f}, "
                  f"{r['step_time_over_none']:.3f}", "", ""]
                 for mode, r in results.get("stall", {}).items() if mode != "none"]  # fmt: skip
        return rows
    if name == "ft_recovery":
        median, faulty = results["median"], results["faulty"]
        return [
            [name, "group 0 s per step (2 groups)", f"{median['group0_step_s']:.3f}", "", ""],
            [name, "death -> first commit without it, s", f"{median['death_to_commit_s']:.2f}", "", ""],
            [name, "restart -> healed first commit, s (heal alone)",
             f"{median['restart_to_first_commit_s']:.2f} ({median['heal_transfer_s']:.3f})", "", ""],
            [name, f"committed steps, {faulty['kills']} kills / none",
             f"{results['committed_steps_faulty_over_baseline']:.3f}", "", ""],
        ]  # fmt: skip
    if name == "sampler_scale":
        rows = [[name, f"{r['implementation']} {r['n']:,} {r['action']}: s / +peak RSS MiB / ns per index",
                 f"{r['seconds']:.3f} / {r['rss_mib']:.0f} / {r['ns_per_index']:.0f}", "", ""]
                for r in results["cases"]]  # fmt: skip
        return rows + [[name, key, f"{value:.1f}x", "", ""] for key, value in results["ratios"].items()]
    if name == "writer_handover":
        return [
            [name, f"{key}: loop time lost s / background s", f"{r['lost_median_s']:.3f} / {r['work_median_s']:.3f}",
             "", ""]
            for key, r in results.items() if isinstance(r, dict)
        ]  # fmt: skip
    if name == "mirror":
        return [
            [name, "step time while uploading / without a mirror", f"{results['step_ratio']:.3f}", "", ""],
            [name, "perdure upload / s3fs plain put, throughput", f"{results['upload_ratio']:.3f}", "", ""],
        ]
    if name == "async_stall":
        return [
            [name, f"{mode}: stall per save s / total s / peak RSS GiB", f"{r['stall_per_save_s']:.3f} / "
             f"{r['total_s']:.1f} / {r['peak_rss_gb']:.2f}", "", ""]
            for mode, r in results.items()
        ]  # fmt: skip
    if name == "model_memory":
        return [
            [name, f"{case}: peak over the baseline / M, construct / build / step / checkpoint / export",
             " / ".join(f"{value:.2f}" for value in r["rise_over_M"].values()), "",
             ""]
            for case, r in results.items()
        ]  # fmt: skip
    return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BENCHMARKS)} (default: all)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.names if name not in BENCHMARKS]:
        parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHMARKS)}")
    names = args.names or list(BENCHMARKS)
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS") or str(DEFAULT_THREADS)

    rows: list[list[Any]] = []
    crashed, missed = [], []
    started = time.perf_counter()
    for name in names:
        result_file = RESULTS_DIR / f"{name}.json"
        result_file.unlink(missing_ok=True)  # never report a stale result for a benchmark that crashed
        print(f"\n=== {name} ===", flush=True)
        begin = time.perf_counter()
        process = subprocess.run([sys.executable, str(HERE / f"{name}.py")], env=env)
        seconds = time.perf_counter() - begin
        if process.returncode != 0 or not result_file.exists():
            crashed.append(name)
            rows.append([name, "exit status", str(process.returncode), "0", "CRASHED"])
            continue
        record = json.loads(result_file.read_text())
        for t in record["targets"]:
            verdict = "met" if t["met"] else "MISSED"
            if not t["met"]:
                missed.append(f"{name}: {t['metric']}")
            rows.append([name, t["metric"], f"{t['value']:.3f}", f"{t['op']} {t['bound']}", verdict])
        rows.extend(summary_rows(name, record))
        rows.append([name, "benchmark wall time, s", f"{seconds:.0f}", "", ""])

    print(f"\n=== summary ({time.perf_counter() - started:.0f}s, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}) ===")
    print(format_table(["benchmark", "metric", "value", "target", "verdict"], rows))
    print(f"details: {RESULTS_DIR}/<benchmark>.json")
    if crashed:
        print(f"crashed: {', '.join(crashed)}")
        return 1
    if missed and args.strict:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
