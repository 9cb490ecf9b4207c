"""`perdure sweep submit --slurm` on a real one-node SLURM cluster (scripts/slurm-local-cluster.sh), started and
stopped by this module. One array of 3 training jobs: one task is preempted by a job in a higher-priority
partition, one is requeued with `scontrol requeue`; all three finish, the two interrupted ones bit-equal to
uninterrupted runs, with 2 attempts and SLURM_RESTART_COUNT=1 on the second. A task whose run is stuck in a crash
loop exits 93 and is not requeued.

Skipped (with the reason) where SLURM is not installed and cannot be (not root, no apt-get), or will not start.
.ci/run installs the packages, so CI always runs these tests.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perdure.sweep.slurm import slurm_view
from tests.runs import LAUNCH_DEFAULTS, REPO, SCRIPTS, environment, run, run_dir
from tests.sweeps import rows, sidecar, status_json, sweep, training_sweep, wait_for, write_matrix
from tests.test_sweep import assert_bit_equal, reference_run

CLUSTER = REPO / "scripts" / "slurm-local-cluster.sh"
PROGRAMS = ("sbatch", "scontrol", "squeue", "slurmctld", "slurmd", "munged")


def clean_environment(**extra: str) -> dict[str, str]:
    """The test environment without SLURM_* / SBATCH_* input variables (sbatch and srun would obey them)."""
    env = {key: value for key, value in environment().items() if not key.startswith(("SLURM_", "SBATCH_"))}
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A running local cluster for the session: the environment that points SLURM's commands at it."""
    if not all(shutil.which(program) for program in PROGRAMS):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip("SLURM is not installed and cannot be here (needs root and apt-get): see docs/sweeps.md")
        installed = subprocess.run(["bash", CLUSTER, "install"], capture_output=True, text=True, timeout=600)
        if installed.returncode != 0:
            pytest.skip(f"the SLURM packages could not be installed: {installed.stderr.strip()[-1000:]}")
    if os.geteuid() != 0:
        pytest.skip("the local SLURM cluster needs root (slurmd runs jobs as their users)")
    directory = tmp_path_factory.mktemp("slurm")
    # 4 CPUs advertised on the 2 cores: the 3 tasks run at once and a 2-CPU job must preempt one of them
    started = subprocess.run(
        ["bash", CLUSTER, "start", str(directory)],
        env=clean_environment(SLURM_LOCAL_CPUS="4"),
        capture_output=True,
        text=True,
        timeout=180,
    )
    try:
        if started.returncode != 0:
            pytest.skip(f"the local SLURM cluster did not start: {(started.stdout + started.stderr).strip()[-1500:]}")
        yield clean_environment(SLURM_CONF=str(directory / "slurm.conf"))
    finally:
        subprocess.run(["bash", CLUSTER, "stop", str(directory)], capture_output=True, timeout=180)


def slurm_command(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{args}: {result.stderr}"
    return result.stdout.strip()


@pytest.mark.timeout(420)
def test_array_with_preemption_and_requeue(slurm, tmp_path, monkeypatch):
    env = slurm
    sweep_dir = training_sweep(tmp_path, steps=80, step_sleep=0.2, seeds=[1, 2, 3], env=env)
    submitted = sweep("submit", str(sweep_dir), "--slurm", env=env)
    assert submitted.returncode == 0, submitted.stderr
    array = re.search(r"submitted array job (\d+): 3 task\(s\)", submitted.stdout).group(1)
    assert {row.slurm_job for row in rows(sweep_dir).values()} == {f"{array}_{index}" for index in range(3)}

    def in_state(state: str) -> list:
        return [row for row in rows(sweep_dir).values() if row.state == state and row.run_dir]

    wait_for(lambda: len(in_state("running")) == 3, 180, "three tasks training")
    # a 2-CPU job in the higher-priority partition: SLURM preempts one task (USR1 first: it saves and exits 138,
    # and the task script requeues it)
    slurm_command(env, "sbatch", "--parsable", "-p", "urgent", "-n", "2", "-o", "/dev/null", "--wrap", "sleep 1")
    (victim,) = wait_for(lambda: in_state("preempted"), 120, "a preempted task")
    requeued = next(row for row in in_state("running") if row.id != victim.id)
    slurm_command(env, "scontrol", "requeue", requeued.slurm_job)  # SIGTERM: it saves and exits 143
    wait_for(lambda: len(in_state("done")) == 3, 300, "all three tasks done")

    view = status_json(sweep_dir, env=env)
    assert view["counts"]["done"] == 3
    attempts = {job["id"]: job["attempts"] for job in view["jobs"]}
    (plain,) = set(attempts) - {victim.id, requeued.id}
    assert attempts == {victim.id: 2, requeued.id: 2, plain: 1}
    assert all(job["slot"].startswith(f"slurm:{array}_") for job in view["jobs"])
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])  # scontrol, called from this process, finds the cluster
    slurm_side = slurm_view([row.slurm_job for row in rows(sweep_dir).values()])
    assert {job: restarts for job, (_, restarts) in slurm_side.items()} == {
        victim.slurm_job: 1,
        requeued.slurm_job: 1,
        rows(sweep_dir)[plain].slurm_job: 0,
    }
    for row, signal_name in ((victim, "SIGUSR1"), (requeued, "SIGTERM")):
        run = sidecar(rows(sweep_dir)[row.id].run_dir)["attempts"]
        assert [(a["status"], a["exit_reason"]) for a in run] == [
            ("preempted", signal_name),
            ("completed", "budget reached"),
        ]
        assert run[0]["restart_counts"] == {} and run[1]["restart_counts"] == {"SLURM_RESTART_COUNT": 1}
    assert len(sidecar(rows(sweep_dir)[plain].run_dir)["attempts"]) == 1
    assert "requeueing" in (sweep_dir / "slurm" / f"{victim.slurm_job}.out").read_text()

    for row in (victim, requeued):
        reference = reference_run(sweep_dir, row.id, tmp_path / f"ref-{row.id}", tmp_path / f"ref-{row.id}.jsonl")
        losses = tmp_path / "losses" / f"{row.id}.jsonl"
        assert_bit_equal(rows(sweep_dir)[row.id].run_dir, reference, losses, tmp_path / f"ref-{row.id}.jsonl")
    assert Path(sweep_dir / "logs" / f"{plain}.log").read_text().count("==> ") == 1
    # the task script hands the job its --signal lead, which the training compares with its first save
    assert "grace window 120s (SLURM's signal lead" in Path(sweep_dir / "logs" / f"{plain}.log").read_text()


@pytest.mark.timeout(300)
def test_an_array_task_never_requeues_a_stuck_run(slurm, tmp_path, monkeypatch):
    env = slurm
    args = ("--steps", "30", "--ckpt.interval", "10", "--resilience.max_attempts_without_progress", "2")
    bug = {"RAISE_AT_STEP": "15"}
    for _ in range(3):  # launched by hand: the first commits step 10, the next two fail without a new checkpoint
        assert run("resumable.py", tmp_path / "runs", *args, **bug).returncode == 1
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(tmp_path / "runs")]
    matrix = write_matrix(tmp_path / "m.yaml", [*command, *LAUNCH_DEFAULTS, *args], jobs=[{}], env=bug)
    assert sweep("init", str(tmp_path / "sw"), str(matrix), env=env).returncode == 0
    submitted = sweep("submit", str(tmp_path / "sw"), "--slurm", env=env)
    assert submitted.returncode == 0, submitted.stderr

    (row,) = wait_for(lambda: [r for r in rows(tmp_path / "sw").values() if r.state == "failed"], 180, "the task")
    assert (row.exit_code, row.attempts) == (93, 1) and "not requeued" in row.note
    monkeypatch.setenv("SLURM_CONF", env["SLURM_CONF"])
    time.sleep(2)  # a requeue would show within the task's own epilog
    ((state, restarts),) = slurm_view([row.slurm_job]).values()
    assert restarts == 0 and state != "PENDING", state
    assert "requeueing" not in (tmp_path / "sw" / "slurm" / f"{row.slurm_job}.out").read_text()
    assert sidecar(row.run_dir or str(run_dir(tmp_path / "runs")))["status"] == "stuck"
