"""`perdure sweep init | run | status | retry | cancel | submit`: a job matrix drained by dispatchers or SLURM.

  perdure sweep init DIR MATRIX.yaml            create the sweep (again: add the matrix's new jobs, keep the rest)
  perdure sweep run DIR --slots N | --gpus 0,1  run queued jobs here until none is queued or running
  perdure sweep status DIR [--json]             jobs, states, attempts, where, run dirs, last metric
  perdure sweep retry DIR JOB... | --failed     queue jobs again (their runs continue where they stopped)
  perdure sweep cancel DIR [JOB...]             cancel jobs (all unfinished ones without JOB); running ones save
  perdure sweep submit DIR --slurm              submit the queued jobs as one SLURM array with requeue

See docs/sweeps.md.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from perdure.cli.runs import table
from perdure.sweep.dispatcher import Dispatcher, make_slots
from perdure.sweep.liveness import dispatcher_alive, hostname, process_alive
from perdure.sweep.matrix import SweepError, load_matrix
from perdure.sweep.slurm import DEFAULT_SIGNAL_BEFORE_S, cancel_slurm, run_task, submit
from perdure.sweep.state import FINAL, JOB_STATES, init_sweep, locked_state, read_state
from perdure.sweep.status import status_json, status_view

_EMPTY = "-"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `sweep` and its subcommands to the `perdure` command's subparsers."""
    parser = subparsers.add_parser(
        "sweep", help="run a job matrix locally or on SLURM", description=__doc__, formatter_class=_Raw
    )
    metavar = "{init,run,status,retry,cancel,submit}"
    commands = parser.add_subparsers(dest="sweep_command", required=True, metavar=metavar)

    init = commands.add_parser("init", help="create or extend a sweep from MATRIX.yaml")
    init.add_argument("dir", help="the sweep directory (created)")
    init.add_argument("matrix", help="MATRIX.yaml: command, grid and/or jobs, env, workdir")
    init.set_defaults(handler=cmd_init)

    run = commands.add_parser("run", help="run queued jobs in local slots")
    run.add_argument("dir")
    where = run.add_mutually_exclusive_group(required=True)
    where.add_argument("--slots", type=int, help="run N jobs at once (no GPU assignment)")
    where.add_argument("--gpus", help="GPU ids, e.g. 0,1,2,3: one job per GPU with CUDA_VISIBLE_DEVICES set")
    run.add_argument("--gpus-per-job", type=int, default=1, help="with --gpus: GPUs per job (default 1)")
    run.add_argument("--retries", type=int, default=0, help="requeue a failed job up to K times (default 0)")
    run.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the sweep (default 1)")
    run.add_argument("--forever", action="store_true", help="keep polling when nothing is left (for new jobs)")
    run.add_argument(
        "--stale-after",
        type=float,
        default=60.0,
        help="a dispatcher on another host whose heartbeat is older than this is dead (default 60 s)",
    )
    run.set_defaults(handler=cmd_run)

    status = commands.add_parser("status", help="a table of jobs and the counts per state")
    status.add_argument("dir")
    status.add_argument("--json", action="store_true", help="print the documented JSON document instead")
    status.add_argument("--no-slurm", action="store_true", help="do not ask SLURM about submitted jobs")
    status.set_defaults(handler=cmd_status)

    retry = commands.add_parser("retry", help="queue jobs again")
    retry.add_argument("dir")
    retry.add_argument("jobs", nargs="*", metavar="JOB", help="job ids")
    retry.add_argument("--failed", action="store_true", help="every failed job")
    retry.set_defaults(handler=cmd_retry)

    cancel = commands.add_parser("cancel", help="cancel jobs (running ones get SIGTERM: they save and exit)")
    cancel.add_argument("dir")
    cancel.add_argument("jobs", nargs="*", metavar="JOB", help="job ids (default: every unfinished job)")
    cancel.set_defaults(handler=cmd_cancel)

    slurm = commands.add_parser("submit", help="submit the queued jobs as a SLURM array")
    slurm.add_argument("dir")
    slurm.add_argument("--slurm", action="store_true", help="submit to SLURM with sbatch (the one backend)")
    slurm.add_argument("--partition", help="sbatch --partition")
    slurm.add_argument("--time", help="sbatch --time, e.g. 4:00:00")
    slurm.add_argument("--gpus-per-job", type=int, help="GPUs per job (sbatch --gres=gpu:G)")
    slurm.add_argument(
        "--signal-before",
        type=int,
        default=DEFAULT_SIGNAL_BEFORE_S,
        help=f"seconds before the time limit at which the job saves and requeues (default {DEFAULT_SIGNAL_BEFORE_S})",
    )
    slurm.add_argument(
        "--sbatch-arg", action="append", default=[], help="another sbatch option, e.g. --sbatch-arg=--ntasks=2"
    )
    slurm.add_argument("--max-tasks", type=int, help="submit at most N jobs (SLURM's MaxArraySize is 1001 by default)")
    slurm.set_defaults(handler=cmd_submit)

    task = commands.add_parser("task")  # what each SLURM array task runs (no help: not listed)
    task.add_argument("dir")
    task.add_argument("job")
    task.set_defaults(handler=cmd_task)
    return parser


class _Raw(argparse.RawDescriptionHelpFormatter):
    pass


# ---------------------------------------------------------------------- handlers


def cmd_init(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.matrix)
    added, kept = init_sweep(args.dir, matrix, default_workdir=Path.cwd())
    state = read_state(args.dir)
    extra = f"; {matrix.duplicates} duplicate job(s) in the matrix ignored" if matrix.duplicates else ""
    print(f"sweep {args.dir}: {len(state.jobs)} job(s), {added} new, {kept} kept{extra}; jobs run in {state.workdir}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    slots = make_slots(slots=args.slots, gpus=args.gpus, gpus_per_job=args.gpus_per_job)
    dispatcher = Dispatcher(
        args.dir, slots, retries=args.retries, poll=args.poll, forever=args.forever, stale_after=args.stale_after
    )
    return dispatcher.run()


def cmd_status(args: argparse.Namespace) -> int:
    view = status_view(read_state(args.dir), use_slurm=not args.no_slurm)
    if args.json:
        print(status_json(view))
        return 0
    rows = []
    for job in view["jobs"]:
        where = ":".join(part for part in (job["host"], job["slot"]) if part) or _EMPTY
        metric = job["last_metric"]
        rows.append(
            [
                job["id"],
                " ".join(f"{key}={_value(value)}" for key, value in job["overrides"].items()) or _EMPTY,
                job["state"],
                str(job["attempts"]),
                where,
                _short_path(job["run_dir"]),
                " ".join(f"{name}={_number(value)}" for name, value in metric.items()) if metric else _EMPTY,
            ]
        )
    headers = ["ID", "OVERRIDES", "STATE", "ATTEMPTS", "HOST:SLOT", "RUN DIR", "LAST METRIC"]
    print(table(headers, [[_printable(cell) for cell in row] for row in rows], right=(3,)))
    counts = view["counts"]
    summary = ", ".join(f"{counts[state]} {state}" for state in JOB_STATES if counts[state])
    print(f"\n{len(view['jobs'])} job(s): {summary or 'none'}")
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    if not args.jobs and not args.failed:
        raise SweepError("say which jobs to retry: job ids, or --failed for every failed job")
    retried = []
    with locked_state(args.dir) as state:
        rows = [state.job(job_id) for job_id in args.jobs]
        if args.failed:
            rows += [row for row in state.jobs if row.state == "failed" and row not in rows]
        for row in rows:
            local = row.slurm_job is None and (row.state == "running" or row.dispatcher is not None)
            if local and dispatcher_alive(args.dir, row.dispatcher or ""):
                raise SweepError(f"job {row.id} is {row.state} (still running): cancel it and wait for it to stop")
            if local and row.host == hostname() and process_alive(row.pid, row.pid_start):
                raise SweepError(f"job {row.id}: its process {row.pid} is still stopping; retry once it has exited")
            if row.slurm_job is not None and row.state not in FINAL:
                raise SweepError(f"job {row.id} is with SLURM as {row.slurm_job}: cancel it first")
        for row in rows:
            row.failures, row.slurm_job, row.retry = 0, None, True
            row.requeue(f"queued again by retry (was {row.state})")
            retried.append(row.id)
    print(f"queued again: {', '.join(retried)}" if retried else "nothing to retry: no job has failed")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with locked_state(args.dir) as state:
        rows = [state.job(job_id) for job_id in args.jobs] or [row for row in state.jobs if row.state not in FINAL]
        rows = [row for row in rows if row.state not in FINAL]
        slurm_jobs = [row.slurm_job for row in rows if row.slurm_job]
        for row in rows:
            running = row.state == "running"
            row.state = "cancelled"
            row.note = "cancelled" + ("; its dispatcher stops it (SIGTERM)" if running and not row.slurm_job else "")
    cancel_slurm(slurm_jobs)
    print(f"cancelled: {', '.join(row.id for row in rows)}" if rows else "nothing to cancel: every job has ended")
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    if not args.slurm:
        raise SweepError("submit needs a backend: add --slurm (submit the queued jobs as a SLURM array)")
    array_id, jobs, script = submit(
        args.dir,
        partition=args.partition,
        time_limit=args.time,
        gpus_per_job=args.gpus_per_job,
        signal_before=args.signal_before,
        sbatch_args=args.sbatch_arg,
        max_tasks=args.max_tasks,
    )
    print(f"submitted array job {array_id}: {len(jobs)} task(s), script {script}")
    for index, job_id in enumerate(jobs):
        print(f"  {array_id}_{index}  {job_id}")
    return 0


def cmd_task(args: argparse.Namespace) -> int:
    return run_task(args.dir, args.job)


# ---------------------------------------------------------------------- formatting


def _value(value: object) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _number(value: object) -> str:
    return f"{value:.5g}" if isinstance(value, float) else _value(value)


def _short_path(path: str | None) -> str:
    """The run dir relative to the working directory when it is inside it (shorter), else as recorded."""
    if not path:
        return _EMPTY
    relative = os.path.relpath(path)
    return relative if not relative.startswith("..") else path


def _printable(text: str) -> str:
    """Text from disk, with control characters escaped so it cannot drive the terminal."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
