"""perdure in 20 seconds: kill -9 a training run, run the same command again, get bit-identical weights.

    python examples/demo.py                   # what `make demo` runs; workspaces under runs/demo/
    python examples/demo.py --root /tmp/demo  # somewhere else (the directory is wiped first)

1. starts `examples/mlp.py` (300 steps, a checkpoint every 50) in a subprocess,
2. waits until two checkpoints are committed, then SIGKILLs it, as a preempted node or a crash would,
3. runs the very same command again: it finds its own checkpoint and resumes by itself,
4. trains an uninterrupted reference run in a separate workspace and compares the final parameters (`model.pth`)
   tensor by tensor with `torch.equal`. Exits 1 unless every tensor is identical.

The demo slows the interrupted run down with `MLP_STEP_DELAY` (sleep per batch; see examples/mlp.py) so that the kill
lands mid-run; the sleep changes nothing in the maths, which the comparison with the undelayed reference shows.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from perdure.errors import CheckpointCorruptError

EXAMPLE = Path(__file__).resolve().parent / "mlp.py"
STEPS = 300  # examples/mlp.py's default budget
WORKSPACES = ("interrupted", "reference")


def say(text: str = "") -> None:
    print(text, flush=True)


def step(number: int, title: str) -> None:
    say()
    say(f"[{number}/4] {title}")


def shown(path: Path) -> str:
    """`path` relative to the current directory when it is below it (shorter commands to read)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class Training:
    """`examples/mlp.py` in a subprocess; its output is echoed, indented, as it arrives."""

    def __init__(self, root: Path, delay: float, echo: Callable[[str], object] = lambda line: True, nproc: int = 1):
        self.root = root
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        prefix = ""
        if delay:
            self.env["MLP_STEP_DELAY"] = str(delay)
            prefix = f"MLP_STEP_DELAY={delay} "
        self.command = [sys.executable, str(EXAMPLE), "--workspace.root", str(root)]
        shown_command = ["python", shown(EXAMPLE), "--workspace.root", shown(root)]
        if nproc > 1:  # DDP on the CPU (gloo): the same program under torchrun
            launcher = ["--standalone", f"--nproc_per_node={nproc}"]
            self.command = [sys.executable, "-m", "torch.distributed.run", *launcher, *self.command[1:]]
            shown_command = ["torchrun", *launcher, *shown_command[1:]]
        say(f"  $ {prefix}{shlex.join(shown_command)}")
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            self.command,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a kill reaches every rank
        )
        self.reader = threading.Thread(target=self._read, args=(echo,), daemon=True)
        self.reader.start()

    def _read(self, echo: Callable[[str], object]) -> None:
        assert self.process.stdout is not None  # started with stdout=PIPE
        for line in self.process.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if echo(line):
                say(f"  | {line}")

    def wait(self, timeout: float = 300) -> int:
        code = self.process.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return code

    def kill(self) -> int:
        """SIGKILL the training and every process it started (torchrun puts each rank in a session of its own)."""
        for pid in [*descendants(self.process.pid), self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return self.wait()

    def output(self) -> str:
        return "\n".join(self.lines)

    def last_step_logged(self) -> int | None:
        return max(progress(self), default=None)


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc (children before their own children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        child = queue.pop(0)
        found.append(child)
        queue.extend(children.get(child, []))
    return found


def progress(training: Training) -> dict[int, str]:
    """Training loss per logged step, from lines like `step 110/300 train: loss 0.28 lr 0.0025 steps_per_s 66`."""
    losses = {}
    for line in training.lines:
        if " train: loss " in line:
            where, _, metrics = line.partition(" train: loss ")
            losses[int(where.rsplit("step ", 1)[1].split("/")[0])] = metrics.split()[0]
    return losses


def committed(root: Path) -> list[Path]:
    """Committed checkpoint directories under a workspace root (a manifest is in place only after the commit)."""
    return sorted(manifest.parent for manifest in root.glob("*/*/checkpoints/ckpt-*/manifest.json"))


def run_dir(root: Path) -> Path:
    found = sorted(path.parent for path in root.glob("*/*/checkpoints"))
    if len(found) != 1:
        fail(f"expected one run directory under {root}, found {[str(p) for p in found]}")
    return found[0]


def show_checkpoints(directory: Path) -> None:
    say(f"  {shown(directory)}/")
    for path in sorted(directory.iterdir()):
        if path.name in ("latest", "best"):
            say(f"    {path.name:<20} -> {read_pointer(directory, path.name)}")
        elif path.name.startswith("ckpt-"):
            try:
                manifest = verify_checkpoint(path)
                files = ", ".join(manifest["files"])
                say(f"    {path.name:<20} step {manifest['global_step']:>3}  verified  ({files}, manifest.json)")
            except CheckpointCorruptError as error:
                say(f"    {path.name:<20} does not verify: {error.reason}")
        else:
            say(f"    {path.name:<20} (a save the kill interrupted: never committed, it will be quarantined)")


def compare(a: Path, b: Path) -> bool:
    first = torch.load(a, weights_only=True)
    second = torch.load(b, weights_only=True)
    if first.keys() != second.keys():
        say(f"  the two exports hold different tensors: {sorted(first)} vs {sorted(second)}")
        return False
    identical = True
    for name in first:
        same = torch.equal(first[name], second[name])
        identical &= same
        detail = "identical" if same else f"DIFFERENT (max |diff| {(first[name] - second[name]).abs().max():.3g})"
        say(f"    {name:<16} {str(tuple(first[name].shape)):<12} {detail}")
    return identical


def fail(message: str) -> None:
    say()
    say(f"demo failed: {message}")
    raise SystemExit(1)


def prepare(root: Path) -> None:
    """Wipe the demo's workspaces. Refuses a directory that holds anything the demo did not make."""
    if root.exists():
        strangers = [path.name for path in root.iterdir() if path.name not in WORKSPACES]
        if strangers:
            fail(f"{root} holds {strangers}, which this demo did not make; pass another --root")
        shutil.rmtree(root)
    root.mkdir(parents=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=Path("runs/demo"), help="demo directory (wiped first)")
    parser.add_argument("--step-delay", type=float, default=0.01, help="seconds slept per batch before the kill")
    parser.add_argument("--kill-after", type=int, default=2, help="committed checkpoints to wait for before the kill")
    parser.add_argument("--nproc", type=int, default=1, help="ranks: above 1, every run is DDP under torchrun (gloo)")
    args = parser.parse_args()
    started = time.monotonic()
    prepare(args.root)
    interrupted, reference = args.root / "interrupted", args.root / "reference"

    say("perdure demo: a training run is killed with SIGKILL mid-run; the same command, run again, resumes by")
    say("itself, and its final weights are compared with those of a run that was never interrupted.")

    step(1, f"Start training: examples/mlp.py, {STEPS} steps, a checkpoint every 50 (slowed down to be killable)")
    run = Training(interrupted, args.step_delay, nproc=args.nproc)
    while len(committed(interrupted)) < args.kill_after:
        if run.process.poll() is not None:
            fail(f"training exited with status {run.process.returncode} before {args.kill_after} checkpoints")
        time.sleep(0.01)
    time.sleep(25 * args.step_delay)  # let it train on past the checkpoint: that work is lost and redone

    step(2, f"{args.kill_after} checkpoints are committed: kill -9 the process, as a preemption or a crash would")
    code = run.kill()
    if code == 0:
        fail("training finished before it could be killed; raise --step-delay")
    directory = run_dir(interrupted)
    say(f"  killed (exit status {code}); the last progress line it printed was step {run.last_step_logged()}")
    say("  what survived on disk:")
    show_checkpoints(directory / "checkpoints")
    if (directory / "model.pth").exists():
        fail("training completed before the kill reached it (model.pth exists); raise --step-delay")
    say("  model.pth does not exist: it is written when training completes")

    step(3, "Run the exact same command again: no flag, no path; it finds its own checkpoint and resumes")
    rerun = Training(interrupted, args.step_delay, nproc=args.nproc)
    if rerun.wait() != 0:
        fail(f"the rerun exited with status {rerun.process.returncode}")
    if "resuming from" not in rerun.output():
        fail(
            "the rerun did not resume from the checkpoint (if tracked files of the repository changed between the "
            "two runs, the code_id, and with it the run directory, changed too)"
        )
    before, after = progress(run), progress(rerun)
    if redone := sorted(set(before) & set(after)):
        last = redone[-1]
        say(
            f"  the steps since the last checkpoint were redone: step {last} logged loss {before[last]} before the "
            f"kill and {after[last]} after the resume"
        )

    step(4, "For comparison: an uninterrupted run, same program and config, in a separate workspace, no slow-down")
    say("  (per-step training lines hidden)")
    baseline = Training(reference, 0.0, echo=lambda line: " train: " not in line, nproc=args.nproc)
    if baseline.wait() != 0:
        fail(f"the reference run exited with status {baseline.process.returncode}")

    killed_model, reference_model = run_dir(interrupted) / "model.pth", run_dir(reference) / "model.pth"
    say()
    say("Final parameters, killed-and-resumed vs uninterrupted (torch.equal on every tensor):")
    say(f"  {shown(killed_model)}")
    say(f"  {shown(reference_model)}")
    identical = compare(killed_model, reference_model)
    say()
    if not identical:
        say("verdict: DIFFERENT - the resumed run does not reproduce the uninterrupted one")
        raise SystemExit(1)
    say("verdict: IDENTICAL - the run killed with SIGKILL and resumed ends with exactly the same weights, bit for bit,")
    say(f"as the run that never stopped. ({time.monotonic() - started:.0f}s)")


if __name__ == "__main__":
    main()
