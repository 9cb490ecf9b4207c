"""Fault tolerance across replica groups, on one machine: a lighthouse, two groups, one of them SIGKILLed.

    python examples/ft_local.py                      # workspace under runs/ft-demo/ (wiped first)
    python examples/ft_local.py --nproc 2            # each group a torchrun of 2 DDP ranks
    python examples/ft_local.py --root /tmp/ft-demo

1. starts a lighthouse (`perdure ft lighthouse`),
2. starts replica groups 0 and 1 of one job (`examples/mlp.py --ft.enabled true --ft.replica_id I ...`): they share
   one run directory and average their gradients every step,
3. SIGKILLs group 1 mid-training; group 0 notices after the lighthouse's heartbeat timeout and keeps committing steps
   alone (the data of group 1's shard is skipped meanwhile),
4. restarts group 1 with the very same command: it heals from group 0 (model, optimizer, scheduler, step, data
   position over HTTP) and both finish the budget together,
5. prints what the run recorded (`perdure runs show`): each group's attempts, quorum changes and heals.

The groups sleep a little per batch (`MLP_STEP_DELAY`) so that the kill and the restart land mid-run. On a machine
with GPUs each group gets GPUs of its own (`CUDA_VISIBLE_DEVICES`, as one would give each group its own node); with
fewer GPUs than the two groups' ranks, the groups train on the CPU: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from perdure.workspace.heartbeat import heartbeat_step

EXAMPLE = Path(__file__).resolve().parent / "mlp.py"
STEPS = 400


def say(text: str = "") -> None:
    print(text, flush=True)


def group_command(replica: int, root: Path, lighthouse: str, nproc: int) -> list[str]:
    launcher = [sys.executable]
    if nproc > 1:  # one torchrun per group; --standalone gives each its own rendezvous
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [
        *launcher, str(EXAMPLE), "--workspace.root", str(root), "--steps", str(STEPS), "--ckpt.interval", "50",
        "--log.interval", "10", "--ft.enabled", "true", "--ft.group_size", "2", "--ft.replica_id", str(replica),
        "--ft.lighthouse", lighthouse,
    ]  # fmt: skip


def group_gpus(replica: int, nproc: int, gpus: int, visible: str | None) -> str | None:
    """The CUDA_VISIBLE_DEVICES of a group: its own `nproc` of the `gpus` this process sees (numbered as `visible`,
    the inherited CUDA_VISIBLE_DEVICES, lists them); "" (the CPU) when the two groups' ranks outnumber the GPUs;
    None (leave it) without GPUs."""
    if gpus == 0:
        return None
    if gpus < 2 * nproc:
        return ""
    names = [name.strip() for name in visible.split(",")][:gpus] if visible else [str(index) for index in range(gpus)]
    return ",".join(names[replica * nproc : (replica + 1) * nproc])


def start_group(replica: int, root: Path, lighthouse: str, nproc: int, attempt: str) -> subprocess.Popen[bytes]:
    log = root.parent / f"group{replica}-{attempt}.log"
    env = {"MLP_STEP_DELAY": "0.05", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "PYTHONUNBUFFERED": "1"}
    gpus = group_gpus(replica, nproc, visible_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    shown = f"CUDA_VISIBLE_DEVICES={gpus} " if gpus is not None else ""
    say(f"  $ {shown}python {' '.join(group_command(replica, root, lighthouse, nproc)[1:])}    # > {log.name}")
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("PERDURE_", "MLP_", "TORCHFT_"))}
    with open(log, "w") as output:
        command = group_command(replica, root, lighthouse, nproc)
        return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env={**environ, **env})


@functools.cache
def visible_gpus() -> int:
    import torch  # here, not at the top: the launcher itself trains nothing

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL a group's launcher and every process below it (torchrun starts its ranks in sessions of their own)."""
    pids, index = [process.pid], 0
    while index < len(pids):  # the process tree, from /proc (Linux)
        for task in Path(f"/proc/{pids[index]}/task").glob("*/children"):
            pids += [int(pid) for pid in task.read_text().split()]
        index += 1
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def run_step(root: Path) -> int:
    """How far the job got: the step its heartbeat last recorded (rewritten at every log line)."""
    for run_dir in [path.parent for path in root.glob("*/*/heartbeat")]:
        return heartbeat_step(run_dir) or 0
    return 0


def ft_record(root: Path, replica: int) -> dict[str, Any]:
    for sidecar in root.glob("*/*/sidecar.json"):
        try:
            record: dict[str, Any] = (
                json.loads(sidecar.read_text()).get("ft", {}).get("replicas", {}).get(str(replica), {})
            )
            return record
        except ValueError:
            return {}  # being replaced: read it again
    return {}


def wait_for(
    condition: Callable[[], object], what: str, processes: list[subprocess.Popen[bytes]], timeout: float = 300
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if any(process.poll() is not None for process in processes) or time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("runs/ft-demo"), help="wiped first (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=1, help="ranks per group (DDP inside each group)")
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    root = args.root / "workspace"
    root.mkdir(parents=True)

    say("[1/5] a lighthouse: the groups meet there at every step")
    lighthouse_command = [sys.executable, "-m", "perdure.cli.main", "ft", "lighthouse", "--bind", "127.0.0.1:0",
                          "--heartbeat-timeout-ms", "2000", "--join-timeout-ms", "500"]  # fmt: skip
    say(f"  $ perdure {' '.join(lighthouse_command[3:])}")
    lighthouse = subprocess.Popen(lighthouse_command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert lighthouse.stdout is not None  # started with stdout=PIPE
    line = lighthouse.stdout.readline().strip()
    say(f"  {line}")
    address = line.split()[3]
    groups: dict[int, subprocess.Popen[bytes]] = {}
    try:
        say("\n[2/5] replica groups 0 and 1 of one job (one run directory)")
        if 0 < (gpus := visible_gpus()) < 2 * args.nproc:
            say(f"  {gpus} GPU(s) for 2 groups of {args.nproc} rank(s): the groups train on the CPU (gloo)")
        groups[0] = start_group(0, root, address, args.nproc, "first")
        groups[1] = start_group(1, root, address, args.nproc, "first")
        wait_for(lambda: run_step(root) >= 60, "the job to train 60 steps", list(groups.values()))

        say("\n[3/5] SIGKILL group 1")
        kill_group(groups[1])  # every process of the group, as a lost node would
        killed_at = run_step(root)
        wait_for(
            lambda: any(q["participants"] == 1 for q in ft_record(root, 0).get("quorum_changes", [])[1:]),
            "group 0 to go on alone",
            [groups[0]],
        )
        alone = [q for q in ft_record(root, 0)["quorum_changes"] if q["participants"] == 1][-1]
        say(f"  group 1 died near step {killed_at}; group 0 trains alone from step {alone['step']}")

        say("\n[4/5] the same command restarts group 1: it heals from group 0")
        groups[1] = start_group(1, root, address, args.nproc, "restart")

        def healed() -> list[dict[str, Any]]:
            return [h for h in ft_record(root, 1).get("heals", []) if h["to_step"] > alone["step"]]

        wait_for(healed, "group 1 to heal", list(groups.values()))
        heal = healed()[0]
        say(f"  healed: step {heal['from_step']} -> {heal['to_step']} in {heal['seconds']}s")
        codes = {replica: process.wait(timeout=600) for replica, process in groups.items()}
        say(f"  exit codes: {codes}")

        say("\n[5/5] what the run recorded")
        run_dirs = [path.parent for path in root.glob("*/*/sidecar.json")]
        say(f"  $ perdure runs show --root {root} {run_dirs[0].name}")
        shown = subprocess.run(
            [sys.executable, "-m", "perdure.cli.main", "runs", "show", "--root", str(root), run_dirs[0].name],
            capture_output=True,
            text=True,
        )
        say(shown.stdout.split("\nhparams")[0])
        return 0 if codes == {0: 0, 1: 0} else 1
    finally:
        for process in groups.values():
            if process.poll() is None:
                kill_group(process)
        lighthouse.send_signal(signal.SIGTERM)
        lighthouse.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
