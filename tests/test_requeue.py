"""A requeued job continues its run whatever changed in the checkout; so does a manual rerun of an unfinished run after
a commit (said in one warning), while a completed run is never continued implicitly. The program lives in its own git
repository, as a user's would, and is stopped by a real SIGTERM or SIGKILL after its first checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perdure.workspace.launch import Launch, current_launch, entry_path, read_entry, write_entry
from perdure.workspace.sidecar import read_sidecar
from tests import zygote
from tests.runs import SCRIPTS, assert_ok, assert_same_weights, environment, read_losses

pytestmark = pytest.mark.timeout(300)

ARGS = ("--steps", "30", "--ckpt.interval", "10")


def git(repo: Path, *args: str) -> str:
    command = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    """A git repository holding a copy of the training program, as a user's checkout would."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(SCRIPTS / "resumable.py", repo / "train.py")
    (repo / "README.md").write_text("a training program\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "first")
    return repo


def commit_something(repo: Path, text: str = "a training program, documented") -> str:
    (repo / "README.md").write_text(text + "\n")
    git(repo, "commit", "-q", "-am", "docs")
    return git(repo, "rev-parse", "--short=7", "HEAD")


def train(repo: Path, root: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(repo / "train.py"), "--workspace.root", str(root), *ARGS, *args]
    return zygote.run(command, env=environment(**env), capture_output=True, text=True, timeout=240)


def train_until_sigterm(repo: Path, root: Path, **env: str) -> subprocess.CompletedProcess:
    """Train until the first checkpoint is committed, then SIGTERM: perdure saves and exits 143."""
    command = [sys.executable, str(repo / "train.py"), "--workspace.root", str(root), *ARGS]
    # Slow steps until the signal is sent: the 20 steps left after the checkpoint take 2 s, so a test process that a
    # loaded machine schedules late still signals a live run (at 0.02 s a step, 0.4 s was once not enough).
    slow = root.parent / f"slow-{os.getpid()}-{time.monotonic_ns()}"
    slow.touch()
    process = zygote.popen(command, env=environment(STEP_SLEEP="0.1", SLOW_WHILE=str(slow), **env),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not list(root.glob("*/*/checkpoints/ckpt-s000000000010/manifest.json")):
        assert process.poll() is None, process.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    slow.unlink()
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 143, output
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def run_dirs(root: Path) -> list[Path]:
    return sorted(path.parent for path in root.glob("*/*/checkpoints"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same program, never stopped."""
    root = tmp_path_factory.mktemp("reference")
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root), *ARGS]
    result = zygote.run(command, env=environment(LOSS_LOG=str(root / "losses.jsonl")), capture_output=True,
                            text=True, timeout=240)  # fmt: skip
    assert_ok(result)
    (run,) = run_dirs(root)
    return {"weights": torch_load(run / "model.pth"), "losses": read_losses(root / "losses.jsonl")}


def torch_load(path: Path):
    import torch

    return torch.load(path, weights_only=True)


def assert_continued_exactly(root: Path, reference: dict, losses: Path) -> Path:
    (run,) = run_dirs(root)  # one run directory: the requeue continued the first one
    assert_same_weights(reference["weights"], torch_load(run / "model.pth"))
    resumed = read_losses(losses)
    assert resumed and min(resumed)[1] >= 10
    for position, loss in resumed.items():
        assert reference["losses"][position] == loss, f"loss at {position} differs"
    return run


@pytest.mark.parametrize(
    "first, restart",
    [
        ({"SLURM_JOB_ID": "4242"}, {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "1"}),
        (
            {"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"},
            {"SLURM_JOB_ID": "77", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "1"},
        ),
        (
            {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "0"},
            {"TORCHELASTIC_RUN_ID": "job-a", "TORCHELASTIC_RESTART_COUNT": "1"},
        ),
    ],
    ids=["slurm", "slurm-array", "torchelastic"],
)
def test_a_restart_after_a_commit_continues_the_same_run(repo, tmp_path, reference, first, restart):
    root = tmp_path / "runs"
    before = git(repo, "rev-parse", "--short=7", "HEAD")
    train_until_sigterm(repo, root, **first)
    after = commit_something(repo)
    result = train(repo, root, LOSS_LOG=str(tmp_path / "losses.jsonl"), **restart)
    assert_ok(result)
    assert "of launch" in result.stdout and "the run its first attempt started" in result.stdout
    assert f"the previous attempt ran {before}, this one runs {after}" in result.stdout
    run = assert_continued_exactly(root, reference, tmp_path / "losses.jsonl")
    attempts = read_sidecar(run / "sidecar.json")["attempts"]
    assert [attempt["code_id"] for attempt in attempts] == [before, after]
    assert (run / "metadata" / "attempts" / attempts[1]["started"] / "git.yaml").read_text().count(after) >= 1


def test_an_interactive_rerun_with_the_same_job_id_is_a_fresh_launch(repo, tmp_path):
    root = tmp_path / "runs"
    train_until_sigterm(repo, root, SLURM_JOB_ID="9")
    commit_something(repo)
    result = train(repo, root, SLURM_JOB_ID="9")  # no restart count: srun again inside the same allocation
    assert_ok(result)
    assert "of launch" not in result.stdout  # not a restart: it continues the unfinished run as a fresh launch does
    assert "continuing the run" in result.stdout and len(run_dirs(root)) == 1


def warnings(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stdout.splitlines() if " WARNING " in line]


def test_a_killed_run_continues_after_a_commit_of_an_unrelated_file(repo, tmp_path, reference):
    root = tmp_path / "runs"
    before = git(repo, "rev-parse", "--short=7", "HEAD")
    killed = train(repo, root, KILL_AT_STEP="15")
    assert killed.returncode == -9, killed.stdout
    after = commit_something(repo)
    (stopped,) = run_dirs(root)

    rerun = train(repo, root, LOSS_LOG=str(tmp_path / "losses.jsonl"))  # the same command
    assert_ok(rerun)
    (warning,) = warnings(rerun)  # one warning, naming both code identities
    assert f"continuing the run {stopped} (step 10, code {before}" in warning and f"this code {after}" in warning
    assert "--workspace.continue_unfinished false" in warning
    run = assert_continued_exactly_in(stopped, reference, tmp_path / "losses.jsonl")
    assert run_dirs(root) == [stopped]
    attempts = read_sidecar(run / "sidecar.json")["attempts"]
    assert [attempt["code_id"] for attempt in attempts] == [before, after]
    assert [attempt["status"] for attempt in attempts] == ["interrupted", "completed"]
    assert after in (run / "metadata" / "attempts" / attempts[1]["started"] / "git.yaml").read_text()
    assert train(repo, root).stdout.count("nothing to train") == 1  # the same command again: the same, finished run

    # A completed run is never continued implicitly: after another commit the same command starts a new run.
    newer = commit_something(repo, "a training program, documented twice")
    fresh = train(repo, root, "--steps", "5")
    assert_ok(fresh)
    assert len(run_dirs(root)) == 2 and "continuing the run" not in fresh.stdout
    (named,) = warnings(fresh)
    assert f"{stopped} (step 30, code {before}" in named and f"a new run in {root}/resumable-{newer}/" in named


def test_continue_unfinished_false_starts_a_separate_run(repo, tmp_path):
    root = tmp_path / "runs"
    train_until_sigterm(repo, root)
    commit_something(repo)
    (stopped,) = run_dirs(root)
    separate = train(repo, root, "--steps", "5", "--workspace.continue_unfinished", "false")
    assert_ok(separate)
    assert len(run_dirs(root)) == 2 and "training " in separate.stdout and "from step 0" in separate.stdout
    (named,) = warnings(separate)
    assert str(stopped) in named and "This start is a new run" in named


def test_the_live_unfinished_run_of_other_code_is_not_trained_twice(repo, tmp_path):
    root = tmp_path / "runs"
    slow = tmp_path / "slow"
    slow.touch()
    # a checkpoint every 2 steps (the interval is no part of the run's identity): held from the start, it commits one
    # after 2 s instead of 10
    command = [sys.executable, str(repo / "train.py"), "--workspace.root", str(root), *ARGS, "--ckpt.interval", "2"]
    live = zygote.popen(command, env=environment(STEP_SLEEP="1", SLOW_WHILE=str(slow)), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        while not list(root.glob("*/*/checkpoints/ckpt-s000000000002/manifest.json")):
            assert live.poll() is None, live.stdout.read()
            time.sleep(0.01)
        commit_something(repo)
        second = train(repo, root)  # the same command while the run it would continue trains
        assert second.returncode == 1, second.stdout
        assert "This launch found no checkpoint under its own code's name" in second.stderr
        assert "rerun with --workspace.continue_unfinished false" in second.stderr
        assert_ok(train(repo, root, "--steps", "5", "--workspace.continue_unfinished", "false"))
    finally:
        slow.unlink()
        output, _ = live.communicate(timeout=120)
    assert live.returncode == 0, output
    assert len(run_dirs(root)) == 2


def test_a_start_from_a_checkpoint_of_the_unfinished_run_branches_a_new_run(repo, tmp_path):
    root = tmp_path / "runs"
    train_until_sigterm(repo, root)
    commit_something(repo)
    (stopped,) = run_dirs(root)
    checkpoint = stopped / "checkpoints" / "ckpt-s000000000010"
    branch = train(repo, root, "--steps", "12", "--checkpoint", str(checkpoint))
    assert_ok(branch)
    assert len(run_dirs(root)) == 2 and "continuing the run" not in branch.stdout
    assert f"starting from checkpoint {checkpoint} (step 10)" in branch.stdout


def test_a_checkout_git_refuses_is_the_same_run_or_a_clear_refusal(repo, tmp_path, reference):
    root = tmp_path / "runs"
    train_until_sigterm(repo, root)
    (stopped,) = run_dirs(root)
    listing = sorted((str(path), path.stat().st_mtime_ns) for path in root.rglob("*"))

    no_git = train(repo, root, PATH=str(tmp_path / "no-git-here"))  # git missing from PATH: nothing is written
    assert no_git.returncode == 1, no_git.stdout
    assert "no `git` program is on PATH" in no_git.stderr and "--workspace.code_id" in no_git.stderr
    assert sorted((str(path), path.stat().st_mtime_ns) for path in root.rglob("*")) == listing

    for path in [repo, *repo.rglob("*")]:  # a checkout owned by another user: git says "dubious ownership"
        os.chown(path, 12345, 12345, follow_symlinks=False)
    assert subprocess.run(["git", "-C", str(repo), "status"], capture_output=True).returncode != 0
    rerun = train(repo, root, LOSS_LOG=str(tmp_path / "losses.jsonl"))
    assert_ok(rerun)
    assert warnings(rerun) == [] and "resuming from" in rerun.stdout
    assert_continued_exactly_in(stopped, reference, tmp_path / "losses.jsonl")
    assert run_dirs(root) == [stopped]


def assert_continued_exactly_in(run: Path, reference: dict, losses: Path) -> Path:
    assert_same_weights(reference["weights"], torch_load(run / "model.pth"))
    for position, loss in read_losses(losses).items():
        assert reference["losses"][position] == loss, f"loss at {position} differs"
    return run


def test_outside_git_editing_the_program_is_a_new_run(tmp_path):
    program = tmp_path / "program"
    program.mkdir()
    shutil.copy(SCRIPTS / "resumable.py", program / "train.py")
    root = tmp_path / "runs"
    first = train(program, root, "--steps", "10")
    assert_ok(first)
    (run,) = run_dirs(root)
    assert run.parent.name.startswith("resumable-src-") and run.name.startswith("src-")
    assert_ok(train(program, root, "--steps", "10"))  # unchanged: the same run (already at its budget)
    assert run_dirs(root) == [run]

    (program / "train.py").write_text((program / "train.py").read_text() + "\n# tuned\n")
    edited = train(program, root, "--steps", "10")
    assert_ok(edited)
    assert len(run_dirs(root)) == 2
    assert "same lineage and config" in edited.stdout


def test_launch_identity_from_the_environment():
    assert current_launch({}) is None
    assert current_launch({"SLURM_RESTART_COUNT": "2"}) is None  # a count without a job names no launch
    assert current_launch({"SLURM_JOB_ID": "5"}) == Launch("slurm:5", 0)
    assert current_launch({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "2"}) == Launch("slurm:5", 2)
    array = {"SLURM_JOB_ID": "8", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1", "SLURM_RESTART_COUNT": "1"}
    assert current_launch(array) == Launch("slurm:7_1", 1)
    # torchrun inside SLURM: the SLURM job names the launch (torchrun's run id is new after a requeue)
    both = {"SLURM_JOB_ID": "5", "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "3"}
    assert current_launch(both) == Launch("slurm:5", 3)
    elastic = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "1"}
    assert current_launch(elastic) == Launch("torchelastic:x", 1)
    assert not current_launch({"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "junk"}).is_restart
    # a job of `perdure sweep run` (also inside a SLURM allocation): its dispatcher numbers the attempts
    sweep = {"PERDURE_LAUNCH_ID": "sweep-ab:job1", "PERDURE_RESTART_COUNT": "2", "SLURM_JOB_ID": "5"}
    assert current_launch(sweep) == Launch("perdure:sweep-ab:job1", 2)


def test_launch_index_entries_are_read_with_care(tmp_path):
    root = tmp_path / "root"
    launch = Launch("slurm:1", 0)
    path = entry_path(root, launch, lineage="mlp", config_id="abc", workspace_id=None)
    assert entry_path(root, launch, lineage="mlp", config_id="abd", workspace_id=None) != path
    write_entry(path, launch=launch, run_dir=root / "mlp-1234567" / "run", root=root, code_id="1234567", run_id="run")
    assert read_entry(path, root)["run_dir"] == "mlp-1234567/run"
    for hostile in ('{"format": "perdure-launch/1", "run_dir": "../../etc", "code_id": null, "run_id": "x"}',
                    '{"format": "perdure-launch/1", "run_dir": "/etc", "code_id": null, "run_id": "x"}',
                    "[" * 100_000, "x" * 100_000, '{"format": 1}'):  # fmt: skip
        path.write_text(hostile)
        assert read_entry(path, root) is None
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({"format": "perdure-launch/1", "run_dir": "a", "run_id": "a"}))
    assert read_entry(path, root) is None  # never followed
