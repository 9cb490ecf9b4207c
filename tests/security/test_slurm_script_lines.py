"""Issue 32, item 5: no value written into a SLURM task script can end its line and run as a command.

The sweep's workdir comes from the matrix (`workdir: "wd\\ntouch PWNED #"`); it used to reach the script's comment
line (`submitted as: ... --chdir=...`) with its newline. The real `perdure sweep submit --slurm` runs against a
stand-in `sbatch` on PATH (it answers a job id, as sbatch --parsable does); every script the submit wrote is then run
with bash as the array task would be.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.runs import environment
from tests.sweeps import echo_command, sweep, write_matrix

pytestmark = pytest.mark.timeout(120)


def run_written_scripts(sweep_dir, env):
    for script in sorted((sweep_dir / "slurm").glob("*.sh")) if (sweep_dir / "slurm").is_dir() else []:
        task = {**env, "SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_JOB_ID": "4242"}
        subprocess.run(
            ["bash", str(script)], env=task, cwd=sweep_dir.parent, capture_output=True, timeout=60, check=False
        )


def test_a_newline_in_the_matrix_workdir_never_becomes_a_command(tmp_path):
    marker = tmp_path / "PWNED"
    workdir = "wd\ntouch PWNED #"  # run in tmp_path, where the task scripts are run below
    (tmp_path / workdir).mkdir()
    matrix = write_matrix(tmp_path / "m.yaml", echo_command(), grid={"seed": [1]}, workdir=workdir)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path / "sbatch-calls"}\necho 4242\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = environment(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert sweep("init", str(tmp_path / "sweep"), str(matrix), env=env).returncode == 0

    result = sweep("submit", str(tmp_path / "sweep"), "--slurm", env=env)
    run_written_scripts(tmp_path / "sweep", env)
    assert not marker.exists(), "a line of the task script ran as a command"
    assert result.returncode != 0, result.stdout + result.stderr
    assert "workdir" in result.stderr and "holds a newline or NUL" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "sbatch-calls").exists(), "refused before anything was submitted"


@pytest.mark.parametrize(
    "option", [("--partition", "gpu\n"), ("--time", "10\n"), ("--sbatch-arg", "--comment=x\n")], ids=str
)
def test_a_trailing_newline_in_an_sbatch_option_is_refused(tmp_path, option):
    # `$` in a regular expression also matches before a final newline: these passed the old patterns
    from perdure.sweep.matrix import SweepError
    from perdure.sweep.slurm import _sbatch_options

    name, value = option
    arguments = {"--partition": (value, None, ()), "--time": (None, value, ()), "--sbatch-arg": (None, None, [value])}
    partition, time_limit, extra = arguments[name]
    with pytest.raises(SweepError, match=name):
        _sbatch_options(partition, time_limit, None, 60, extra)
