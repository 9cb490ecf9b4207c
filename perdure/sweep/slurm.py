"""SLURM: `perdure sweep submit DIR --slurm` sends the claimable jobs as one sbatch array; each array task runs
`perdure sweep task DIR JOB` under a small bash script that handles SLURM's signals.

The array is submitted with `--requeue --open-mode=append --signal=B:USR1@S`. The task script:
- maps `SLURM_ARRAY_TASK_ID` to its job id (the list is written into the script) and starts
  `python -m perdure.cli.main sweep task DIR JOB` in the background (bash runs traps only between commands);
- on USR1 (`--signal` S seconds before the time limit, or a preemption with `preempt_send_user_signal`) forwards it:
  the training saves and exits 138; the script then requeues its own task with
  `scontrol requeue ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}` (SLURM does not requeue a job that ran out of
  time);
- on SIGTERM (a partition preemption with PreemptMode=REQUEUE, `scontrol requeue`, `scancel`) forwards it: the
  training saves and exits 143, and SLURM itself requeues (or cancels) the task.
The requeued task reruns the same job, which continues the same run dir; `SLURM_RESTART_COUNT` is recorded in the
run's attempts (`perdure runs show`).

`sweep task` records the attempt in the sweep's state (running, host, `slurm:ARRAY_INDEX`, attempts, exit). For the
moments the task could not record (SIGKILL after KillWait, a node failure), `perdure sweep status` reads SLURM's own
view (`scontrol show job`; accounting / `sacct` is not assumed) and shows it for rows that have not ended.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from perdure.resilience.crash_loop import RETRY_ENV
from perdure.sweep.launch import JobProcess, job_environment
from perdure.sweep.liveness import hostname
from perdure.sweep.matrix import SweepError
from perdure.sweep.state import CLAIMABLE, FINAL, JobRow, locked_state, log_path
from perdure.workspace.sidecar import utc_stamp

SLURM_DIR = "slurm"
DEFAULT_SIGNAL_BEFORE_S = 120
_SBATCH_TIMEOUT_S = 60
_TASK_POLL_S = 0.2
# Matched whole (`fullmatch`: `$` would also match before a final newline).
_TIME_PATTERN = re.compile(r"(\d+-)?\d+(:\d+){0,2}|\d+-\d+|INFINITE|UNLIMITED", re.IGNORECASE)
_ARG_PATTERN = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=.*)?")

# SLURM job states, as our states (for rows the task could not update itself).
SLURM_TO_STATE = {
    "PENDING": "queued",
    "CONFIGURING": "running",
    "RUNNING": "running",
    "COMPLETING": "running",
    "SUSPENDED": "running",
    "STOPPED": "running",
    "RESIZING": "running",
    "REQUEUED": "preempted",
    "REQUEUE_FED": "preempted",
    "REQUEUE_HOLD": "preempted",
    "PREEMPTED": "preempted",
    "COMPLETED": "done",
    "CANCELLED": "cancelled",
    "FAILED": "failed",
    "TIMEOUT": "failed",
    "NODE_FAIL": "failed",
    "OUT_OF_MEMORY": "failed",
    "BOOT_FAIL": "failed",
    "DEADLINE": "failed",
}

TASK_SCRIPT = """#!/bin/bash
# perdure sweep array task, written by `perdure sweep submit` (submitted as: {sbatch})
# task index -> job id; the task runs `perdure sweep task DIR JOB`, which runs the job and records it in the sweep.
jobs=({jobs})
job=${{jobs[$SLURM_ARRAY_TASK_ID]}}
# The training reads its grace window from this (a job cannot see its own --signal): see docs/resilience.md.
export SBATCH_SIGNAL=B:USR1@{signal_before}
{python} -m perdure.cli.main sweep task {sweep_dir} "$job" &
child=$!
usr1=0
# USR1 (--signal=B:USR1@S): the training saves and exits 138, then this task requeues itself.
trap 'usr1=1; kill -USR1 $child 2>/dev/null' USR1
# SIGTERM (preemption, scontrol requeue, scancel): the training saves and exits 143; SLURM requeues or cancels.
trap 'kill -TERM $child 2>/dev/null' TERM
while kill -0 $child 2>/dev/null; do wait $child; done
wait $child
rc=$?
if [ "$usr1" = 1 ] && [ "$rc" = 138 ]; then
  echo "perdure sweep: $job saved after USR1; requeueing ${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
  scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}" && exit 0
fi
exit $rc
"""


# ---------------------------------------------------------------------- submit


def submit(
    sweep_dir: str | os.PathLike,
    *,
    partition: str | None = None,
    time_limit: str | None = None,
    gpus_per_job: int | None = None,
    signal_before: int = DEFAULT_SIGNAL_BEFORE_S,
    sbatch_args: Sequence[str] = (),
    max_tasks: int | None = None,
    environment: dict[str, str] | None = None,
) -> tuple[str, list[str], Path]:
    """Submit every claimable job (queued or preempted, not already with SLURM), or the first `max_tasks`, as one
    array.

    Returns (array job id, job ids in task order, script path). The rows are marked with their `ARRAY_INDEX` in the
    same locked update, so no local dispatcher takes them afterwards.
    """
    sweep_dir = Path(sweep_dir).resolve()
    options = _sbatch_options(partition, time_limit, gpus_per_job, signal_before, sbatch_args)
    _one_line("the sweep folder", sweep_dir)
    _one_line("the Python interpreter", sys.executable)
    with locked_state(sweep_dir) as state:
        _one_line("the sweep's workdir (matrix key workdir)", state.workdir)
        rows = [row for row in state.jobs if row.state in CLAIMABLE and row.slurm_job is None]
        if max_tasks is not None:
            if max_tasks < 1:
                raise SweepError(f"--max-tasks {max_tasks}: give at least 1")
            rows = rows[:max_tasks]
        if not rows:
            raise SweepError(f"nothing to submit in {sweep_dir}: no job is queued or preempted (see `sweep status`)")
        (sweep_dir / SLURM_DIR).mkdir(exist_ok=True)
        options += [
            f"--array=0-{len(rows) - 1}",
            f"--output={sweep_dir / SLURM_DIR}/%A_%a.out",
            f"--chdir={state.workdir}",
        ]
        for row in rows:
            _one_line("job id", row.id)
        script = sweep_dir / SLURM_DIR / f"array-{utc_stamp()}.sh"
        command = ["sbatch", "--parsable", *options, str(script)]
        text = TASK_SCRIPT.format(
            sbatch=" ".join(shlex.quote(arg) for arg in command),
            jobs=" ".join(row.id for row in rows),
            python=shlex.quote(sys.executable),
            sweep_dir=shlex.quote(str(sweep_dir)),
            signal_before=signal_before,
        )
        with open(script, "x", encoding="utf-8") as file:
            file.write(text)
        os.chmod(script, 0o755)
        array_id = _sbatch(command, cwd=state.workdir, env=environment)
        for index, row in enumerate(rows):
            row.slurm_job = f"{array_id}_{index}"
            row.state, row.host, row.slot = "queued", None, None
            row.note = f"submitted to SLURM as {row.slurm_job}"
    return array_id, [row.id for row in rows], script


def _one_line(what: str, value: object) -> None:
    """Every value written into the task script stays on its line: a newline (or NUL) ends a line of bash, even one
    quoted in a comment, and what follows would run as a command of the array task."""
    text = str(value)
    if any(char in text for char in "\n\r\0"):
        raise SweepError(
            f"{what} {text!r} holds a newline or NUL: it would end a line of the SLURM task script and the rest would "
            "run as a command. Rename it (or give another one) and submit again; nothing was submitted."
        )


def _sbatch_options(
    partition: str | None, time_limit: str | None, gpus_per_job: int | None, signal_before: int, extra: Sequence[str]
) -> list[str]:
    if signal_before < 1:
        raise SweepError(f"--signal-before {signal_before}: give the seconds before the time limit (>= 1)")
    options = ["--job-name=perdure-sweep", "--requeue", "--open-mode=append", f"--signal=B:USR1@{signal_before}"]
    if partition is not None:
        if not re.fullmatch(r"[A-Za-z0-9_.,-]+", partition):
            raise SweepError(f"--partition {partition!r}: not a partition name")
        options.append(f"--partition={partition}")
    if time_limit is not None:
        if not _TIME_PATTERN.fullmatch(time_limit):
            raise SweepError(f"--time {time_limit!r}: use SLURM's form: minutes, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]")
        options.append(f"--time={time_limit}")
    if gpus_per_job is not None:
        if gpus_per_job < 0:
            raise SweepError(f"--gpus-per-job {gpus_per_job}: give 0 or more")
        if gpus_per_job:
            options.append(f"--gres=gpu:{gpus_per_job}")
    for arg in extra:
        _one_line("--sbatch-arg", arg)
        if not _ARG_PATTERN.fullmatch(arg) or arg.split("=")[0] in ("--array", "--output", "--parsable", "--wrap"):
            raise SweepError(f"--sbatch-arg {arg!r}: give one sbatch option as --name=value (not --array/--output)")
        options.append(arg)
    return options


def _sbatch(command: list[str], *, cwd: str, env: dict[str, str] | None) -> str:
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=_SBATCH_TIMEOUT_S, cwd=cwd, env=env, check=False
        )
    except FileNotFoundError:
        raise SweepError("sbatch is not on PATH: submit from a SLURM login node (or run the sweep locally)") from None
    except subprocess.TimeoutExpired:
        raise SweepError(f"sbatch did not answer within {_SBATCH_TIMEOUT_S} s: is slurmctld up? (try sinfo)") from None
    if result.returncode != 0:
        raise SweepError(f"sbatch failed (exit {result.returncode}): {result.stderr.strip() or result.stdout.strip()}")
    array_id = result.stdout.strip().split(";")[0]
    if not array_id.isdigit():
        raise SweepError(f"sbatch answered {result.stdout.strip()!r}, not a job id")
    return array_id


# ---------------------------------------------------------------------- one array task


class _Forwarder:
    """Signal handlers of `sweep task`: each signal is forwarded to the job (perdure saves and exits)."""

    def __init__(self) -> None:
        self.job: JobProcess | None = None
        self.pending: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.job is not None:
            self.job.signal(signum)
        else:
            self.pending.append(signum)


def run_task(sweep_dir: str | os.PathLike, job_id: str) -> int:
    """Run one job as this SLURM array task and record it in the sweep; returns the job's exit status."""
    sweep_dir = Path(sweep_dir).resolve()
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    slurm_job = f"{array}_{index}" if array and index else None
    if slurm_job is None:
        raise SweepError("`perdure sweep task` runs inside a SLURM array task (SLURM_ARRAY_JOB_ID is not set)")
    forward = _Forwarder()
    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with locked_state(sweep_dir) as state:
            row = state.job(job_id)
            # a task runs only the row submitted as this task; `running` here is its own earlier attempt, which
            # died without recording its end (SIGKILL after KillWait, a node failure)
            if row.state in FINAL or row.slurm_job != slurm_job:
                print(f"perdure sweep: not running {job_id}: it is {row.state} ({row.note})", flush=True)
                return 0
            row.start_attempt(host=hostname(), slot=f"slurm:{slurm_job}", slurm_job=slurm_job)
            restarts = os.environ.get("SLURM_RESTART_COUNT")
            if restarts:
                assert row.note is not None  # `start_attempt` just wrote it
                row.note += f" (SLURM_RESTART_COUNT={restarts})"
            job = _job_process(sweep_dir, state, row, retry=bool(row.retry))
            row.retry = None
            job.start()
            row.pid, row.pid_start = job.pid, job.pid_start
            forward.job = job
        for signum in forward.pending:
            job.signal(signum)
        recorded = None
        while job.poll() is None:
            time.sleep(_TASK_POLL_S)
            found = job.find_run_dir()
            if found is not None and found != recorded:
                with locked_state(sweep_dir) as state:
                    state.job(job_id).run_dir = recorded = found
        code = job.wait()
        with locked_state(sweep_dir) as state:
            row = state.job(job_id)
            row.run_dir = job.find_run_dir() or row.run_dir
            if row.slurm_job == slurm_job and row.state in ("running", "cancelled"):
                row.finish_attempt(code)
            print(f"perdure sweep: {job_id} {row.state} ({row.note})", flush=True)
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _job_process(sweep_dir: Path, state, row: JobRow, *, retry: bool = False) -> JobProcess:
    argv = state.argv(row)
    extra = {"PERDURE_SWEEP_DIR": str(sweep_dir), "PERDURE_SWEEP_JOB": row.id}
    if retry:  # the first launch after `perdure sweep retry`: a run stuck in a crash loop tries again
        extra[RETRY_ENV] = "1"
    header = f"{utc_stamp()} attempt {row.attempts} of {row.id} on {row.host}:{row.slot}: {shlex.join(argv)}"
    return JobProcess(
        argv,
        env=job_environment(os.environ, state.env, **extra),
        cwd=state.workdir,
        log=log_path(sweep_dir, row.id),
        header=header,
    )


# ---------------------------------------------------------------------- SLURM's view


def slurm_view(slurm_jobs: Sequence[str]) -> dict[str, tuple[str, int]]:
    """`{ARRAY_INDEX: (SLURM JobState, Restarts)}` for the given tasks, from `scontrol show job -o ARRAY` (finished
    jobs stay there for MinJobAge). Tasks SLURM no longer knows are left out; without scontrol the result is empty."""
    arrays = sorted({job.split("_")[0] for job in slurm_jobs if job.split("_")[0].isdigit()})
    view: dict[str, tuple[str, int]] = {}
    for array in arrays:
        try:
            result = subprocess.run(
                ["scontrol", "show", "job", "-o", array], capture_output=True, text=True, timeout=30, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return view
        if result.returncode != 0:
            continue
        for line in result.stdout.splitlines()[:100_000]:
            fields = dict(token.split("=", 1) for token in line.split() if "=" in token)
            state = fields.get("JobState", "")
            restarts = int(fields["Restarts"]) if fields.get("Restarts", "").isdigit() else 0
            for index in _task_ids(fields.get("ArrayTaskId", "")):
                view[f"{fields.get('ArrayJobId', array)}_{index}"] = (state, restarts)
    return view


def _task_ids(text: str) -> list[int]:
    """`3` -> [3]; `0-2` -> [0, 1, 2]; `1,4-5%2` -> [1, 4, 5] (a pending array's remaining tasks)."""
    out: list[int] = []
    for part in text.split("%")[0].split(","):
        bounds = part.split("-")
        if len(bounds) == 1 and bounds[0].isdigit():
            out.append(int(bounds[0]))
        elif len(bounds) == 2 and all(bound.isdigit() for bound in bounds):
            out.extend(range(int(bounds[0]), min(int(bounds[1]), int(bounds[0]) + 100_000) + 1))
    return out


def merged_state(row: JobRow, view: dict[str, tuple[str, int]]) -> str:
    """The state to show for a SLURM row: ours once it ended, else SLURM's (a requeued task waiting to rerun after a
    preemption stays `preempted`)."""
    if row.slurm_job is None or row.state in FINAL or row.slurm_job not in view:
        return row.state
    slurm_state = view[row.slurm_job][0].split("+")[0]
    mapped = SLURM_TO_STATE.get(slurm_state, row.state)
    if mapped == "queued" and row.state == "preempted":
        return "preempted"
    return mapped


def cancel_slurm(slurm_jobs: Sequence[str]) -> None:
    """`scancel` the given array tasks (their training gets SIGTERM, saves and exits)."""
    if not slurm_jobs:
        return
    try:
        result = subprocess.run(["scancel", *slurm_jobs], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SweepError(f"scancel failed: {error}; cancel {' '.join(slurm_jobs)} by hand") from None
    if result.returncode != 0:
        raise SweepError(f"scancel {' '.join(slurm_jobs)} failed: {result.stderr.strip()}")
