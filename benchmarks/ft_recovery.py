"""TorchFT recovery: what the death of a replica group costs the survivor, how long a restarted group takes to heal,
and which share of the steps still commits when a group is killed every N seconds.

Two replica groups (one process each, gloo on CPU) of `benchmarks/_ft_group.py` (an MLP whose steps take about
`--step-delay` seconds more than their math) and a lighthouse in this process (heartbeat timeout `--heartbeat-ms`).
Every group logs the time, outcome and quorum size of each step attempt.

- death -> first committed step without the group: group 1 is SIGKILLed while both train; the time from the kill
  to group 0's first step committed by a quorum of one. Baseline: group 0's median time per step with both groups
  just before (measured in the same run), and the lighthouse's heartbeat timeout, which bounds the detection.
- restart -> healed: group 1 is relaunched with its same command; the time from the launch to its first committed
  step (process start, joining, the heal from group 0, its first step), and the heal transfer alone.
- committed share under faults: `--duration` seconds with group 1 SIGKILLed every `--every` seconds and relaunched at
  once, against `--duration` seconds without faults in the same run: the job's committed steps (group 0's, which
  never dies), as a ratio; and the share of group 0's step attempts that committed.

    python benchmarks/ft_recovery.py [--kills 3] [--duration 40] [--every 10] [--heartbeat-ms 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import RESULTS_DIR, format_table, format_targets, load_note, median, setup_threads, target, write_results

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from perdure.ft.lighthouse import address, start_lighthouse  # noqa: E402
from perdure.workspace.sidecar import parse_stamp  # noqa: E402

NAME = "ft_recovery"
GROUP = Path(__file__).resolve().parent / "_ft_group.py"
TARGET_RECOVERY_OVER_HEARTBEAT = 2.0  # the survivor commits again within two heartbeat timeouts of a death


class Job:
    """The two groups of one job under `root`; each launch of a group writes its own commit log."""

    def __init__(self, root: Path, lighthouse: str, step_delay: float) -> None:
        self.root, self.lighthouse, self.step_delay = root, lighthouse, step_delay
        self.processes: dict[int, subprocess.Popen] = {}
        self.launches = {0: 0, 1: 0}
        root.mkdir(parents=True)

    def log(self, replica: int, launch: int | None = None) -> Path:
        return self.root / f"commits{replica}-{self.launches[replica] if launch is None else launch}.txt"

    def start(self, replica: int) -> float:
        self.launches[replica] += 1
        command = [sys.executable, str(GROUP), "--workspace.root", str(self.root / "runs"), "--ft.enabled", "true",
                   "--ft.group_size", "2", "--ft.replica_id", str(replica), "--ft.lighthouse", self.lighthouse,
                   "--ft.timeout", "10"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO)}
        env.update(COMMIT_LOG=str(self.log(replica)), STEP_DELAY=str(self.step_delay))
        output = open(self.root / f"group{replica}-{self.launches[replica]}.out", "w")  # noqa: SIM115
        started = time.time()
        self.processes[replica] = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        return started

    def kill(self, replica: int) -> float:
        killed = time.time()
        self.processes[replica].send_signal(signal.SIGKILL)
        self.processes[replica].wait()
        return killed

    def attempts(self, replica: int, launch: int | None = None) -> list[tuple[float, bool, int, int]]:
        path = self.log(replica, launch)
        lines = path.read_text().splitlines() if path.exists() else []
        return [(float(t), c == "1", int(s), int(g)) for t, c, s, g in (line.split() for line in lines if line)]

    def wait(self, condition: Any, what: str, live: tuple[int, ...] = (0, 1), timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            for replica in live:
                process = self.processes[replica]
                if process.poll() is not None:
                    raise RuntimeError(f"group {replica} exited ({process.returncode}) before {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def both_commit(self, steps: int = 20) -> None:
        """Wait until the current launch of group 1 committed `steps` steps in a quorum of two."""
        self.wait(lambda: sum(c and g == 2 for _, c, _, g in self.attempts(1)) >= steps, "both groups training")

    def heals_since(self, since: float) -> list[dict[str, Any]]:
        """Group 1's heals recorded after `since` (a unix time), from the run's sidecar."""
        for path in (self.root / "runs").glob("*/*/sidecar.json"):
            try:
                heals = json.loads(path.read_text())["ft"]["replicas"]["1"]["heals"]
            except (ValueError, KeyError):
                return []
            return [heal for heal in heals if (parse_stamp(heal["at"]) or 0) > since]
        return []

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def recovery_cycles(job: Job, kills: int) -> list[dict[str, float]]:
    job.start(0)
    job.start(1)
    cycles = []
    for _ in range(kills):
        job.both_commit()
        killed = job.kill(1)
        before = [t for t, c, _, g in job.attempts(0) if c and g == 2 and t < killed][-20:]
        step_s = median(b - a for a, b in zip(before, before[1:]))

        def alone(killed: float = killed) -> list[float]:
            return [t for t, c, _, g in job.attempts(0) if c and g == 1 and t > killed]

        job.wait(alone, "group 0 committing alone", live=(0,))
        recovered = alone()[0] - killed
        launched = job.start(1)
        job.wait(lambda: any(c for _, c, _, _ in job.attempts(1)), "the restarted group's first step")  # noqa: B023
        first = next(t for t, c, _, _ in job.attempts(1) if c)
        job.wait(lambda: job.heals_since(launched), "the heal record")  # noqa: B023
        cycles.append(
            {
                "group0_step_s": step_s,
                "death_to_commit_s": recovered,
                "restart_to_first_commit_s": first - launched,
                "heal_transfer_s": job.heals_since(launched)[0]["seconds"],
            }
        )
        print(f"  cycle {len(cycles)}: " + ", ".join(f"{k} {v:.3f}" for k, v in cycles[-1].items()), flush=True)
    return cycles


def committed_over(job: Job, duration: float, every: float | None) -> dict[str, float]:
    """Steps group 0 commits in `duration` seconds, with group 1 killed and relaunched every `every` seconds."""
    job.start(0)
    job.start(1)
    job.both_commit()
    start = time.time()
    kills = 0
    while time.time() - start < duration:
        if every is not None and time.time() - start >= (kills + 1) * every:
            job.kill(1)
            job.start(1)
            kills += 1
        time.sleep(0.05)
    end = time.time()
    window = [(c, g) for t, c, _, g in job.attempts(0) if start <= t <= end]
    return {
        "committed_steps": sum(c for c, _ in window),
        "attempts": len(window),
        "committed_share_of_attempts": sum(c for c, _ in window) / max(len(window), 1),
        "steps_in_quorum_of_two": sum(c and g == 2 for c, g in window),
        "kills": kills,
        "seconds": end - start,
    }


@contextlib.contextmanager
def _closing(jobs: list[Job]) -> Any:
    """Every group killed before its directory is removed."""
    try:
        yield
    finally:
        for job in jobs:
            job.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3, help="death / restart cycles measured (default: 3)")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of each committed-share run")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between kills in the faulty run")
    parser.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    parser.add_argument("--step-delay", type=float, default=0.02, help="extra seconds per step (default: 0.02)")
    args = parser.parse_args()
    threads = setup_threads()
    server = start_lighthouse("127.0.0.1:0", heartbeat_timeout_ms=args.heartbeat_ms, join_timeout_ms=300)
    lighthouse = address(server, "127.0.0.1:0")
    RESULTS_DIR.mkdir(exist_ok=True)
    jobs: list[Job] = []
    try:
        with tempfile.TemporaryDirectory(dir=RESULTS_DIR, prefix="ft-") as tmp, _closing(jobs):
            print(f"death / restart cycles ({args.kills})", flush=True)
            jobs.append(Job(Path(tmp) / "cycles", lighthouse, args.step_delay))
            cycles = recovery_cycles(jobs[-1], args.kills)
            jobs[-1].close()
            print(f"{args.duration:.0f} s with group 1 killed every {args.every:.0f} s, then none", flush=True)
            jobs.append(Job(Path(tmp) / "faults", lighthouse, args.step_delay))
            faulty = committed_over(jobs[-1], args.duration, args.every)
            jobs[-1].close()
            jobs.append(Job(Path(tmp) / "baseline", lighthouse, args.step_delay))
            baseline = committed_over(jobs[-1], args.duration, None)
            jobs[-1].close()
    finally:
        server.shutdown()

    summary = {key: median(cycle[key] for cycle in cycles) for key in cycles[0]}
    heartbeat_s = args.heartbeat_ms / 1000
    share = faulty["committed_steps"] / max(baseline["committed_steps"], 1)
    results = {
        "cycles": cycles,
        "median": summary,
        "death_to_commit_over_heartbeat": summary["death_to_commit_s"] / heartbeat_s,
        "faulty": faulty,
        "baseline": baseline,
        "committed_steps_faulty_over_baseline": share,
    }
    rows = [
        ["group 0 time per step, both groups (baseline)", summary["group0_step_s"]],
        ["death -> first step committed without the group, s", summary["death_to_commit_s"]],
        ["  / heartbeat timeout", results["death_to_commit_over_heartbeat"]],
        ["restart -> first committed step (healed), s", summary["restart_to_first_commit_s"]],
        ["  of which the heal transfer, s", summary["heal_transfer_s"]],
        [f"committed steps, kill every {args.every:.0f} s / no kill", share],
        ["share of group 0's step attempts committed (kills)", faulty["committed_share_of_attempts"]],
    ]
    print(format_table(["metric (median of cycles)", "value"], rows))
    targets = [
        target(
            "death_to_commit_over_heartbeat",
            results["death_to_commit_over_heartbeat"],
            "<=",
            TARGET_RECOVERY_OVER_HEARTBEAT,
        )
    ]
    print(format_targets(targets))
    if note := load_note():
        print(f"note: {note}")
    config = {**vars(args), "threads": threads, "groups": 2, "ranks_per_group": 1}
    print(f"wrote {write_results(NAME, config, results, targets)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
