"""Grace windows: where perdure reads them, and the one warning when the first save does not fit."""

from __future__ import annotations

import pytest

from perdure.resilience.grace import _launcher_flag, find_grace
from tests.runs import assert_ok, run

TORCHRUN = {"TORCHELASTIC_RUN_ID": "job"}


@pytest.mark.parametrize(
    ("env", "seconds", "source"),
    [
        ({}, None, None),
        ({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "5"}, None, None),  # not under torchrun: nothing enforces it
        (TORCHRUN, 30, "torchrun's shutdown timeout, its default of 30 s"),
        ({**TORCHRUN, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, 90, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT=90"),
        (
            {**TORCHRUN, "PET_SHUTDOWN_TIMEOUT": "45", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"},
            45,
            "PET_SHUTDOWN_TIMEOUT",
        ),
        ({**TORCHRUN, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, 30, "its default"),
        ({"SLURM_JOB_ID": "7", "SBATCH_SIGNAL": "B:USR1@120"}, 120, "SBATCH_SIGNAL=B:USR1@120"),
        ({"SLURM_JOB_ID": "7", "SBATCH_SIGNAL": "USR1"}, 60, "SBATCH_SIGNAL=USR1"),  # sbatch's default lead
        ({"SLURM_JOB_ID": "7", "SBATCH_SIGNAL": "R:10@90"}, 90, "SLURM's signal lead"),
        ({"SLURM_JOB_ID": "7", "SBATCH_SIGNAL": "USR1@ninety"}, None, None),
        ({"SLURM_JOB_ID": "7"}, None, None),  # `#SBATCH --signal` is not visible to the job: resilience.grace_s
        ({**TORCHRUN, "SLURM_JOB_ID": "7", "SBATCH_SIGNAL": "B:USR1@20"}, 20, "SLURM"),  # the shorter one counts
    ],
)
def test_the_grace_window_is_read_from_the_launchers_environment(env, seconds, source):
    grace = find_grace(None, env)
    assert (grace and grace.seconds) == seconds
    if source is not None:
        assert source in grace.source


def test_the_configured_grace_wins_and_torchruns_command_line_is_read_as_torchrun_reads_it():
    assert find_grace(15, {**TORCHRUN, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}).seconds == 15
    python = ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    assert _launcher_flag([*python, "--shutdown-timeout", "120", "train.py"]) == 120
    assert _launcher_flag([*python, "--shutdown_timeout=75", "train.py"]) == 75
    assert _launcher_flag(["/venv/bin/torchrun", "train.py"]) is None
    assert _launcher_flag(["/usr/bin/python3", "train.py", "--shutdown-timeout", "5"]) is None  # not torchrun's


def test_the_first_save_longer_than_the_grace_warns_once(tmp_path):
    result = run("resumable.py", tmp_path, "--steps", "20", "--ckpt.interval", "10", "--resilience.grace_s", "0.0001")
    assert_ok(result)
    output = result.stdout + result.stderr
    assert output.count("longer than the 0.0001s grace window (resilience.grace_s)") == 1, output
    fits = run(
        "resumable.py", tmp_path / "fits", "--steps", "10", "--ckpt.interval", "10", "--resilience.grace_s", "600"
    )
    assert_ok(fits)
    assert "grace window 600s (resilience.grace_s); the first save took" in fits.stdout + fits.stderr
