"""The examples run as a user runs them: `examples/mlp.py` trains, resumes and extends; `examples/demo.py` shows a
SIGKILLed run resuming to bit-identical weights; `examples/ft_local.py` kills a TorchFT replica group and heals it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runs import skip_unless_ranks_fit

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PERDURE_", "MLP_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    command = [sys.executable, str(EXAMPLES / script), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_mlp_trains_resumes_and_extends(tmp_path):
    args = ("--workspace.root", str(tmp_path), "--steps", "40", "--ckpt.interval", "20")
    first = run("mlp.py", *args)
    assert "starting fresh at step 0" in first.stdout
    assert "finished at step 40" in first.stdout
    (run_dir,) = [path.parent for path in tmp_path.glob("*/*/checkpoints")]
    checkpoints = run_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.glob("ckpt-*")) == ["ckpt-s000000000020", "ckpt-s000000000040"]
    assert (checkpoints / "latest").read_text().strip() == "ckpt-s000000000040"
    weights = torch.load(run_dir / "model.pth", weights_only=True)
    assert set(weights) == {f"net.{i}.{kind}" for i in (0, 3, 6) for kind in ("weight", "bias")}
    accuracy = first.stdout.rsplit("val: loss", 1)[1].split("accuracy", 1)[1].split()[0]
    assert float(accuracy) > 0.5, first.stdout  # 4 classes: it learned something

    again = run("mlp.py", *args)  # the same command once more: nothing left to train
    assert "nothing to train" in again.stdout

    extended = run("mlp.py", *args[:2], "--steps", "60", "--ckpt.interval", "20")  # a larger budget continues it
    assert "resuming from" in extended.stdout and "ckpt-s000000000040" in extended.stdout
    assert "finished at step 60" in extended.stdout
    assert [path.parent for path in tmp_path.glob("*/*/checkpoints")] == [run_dir]


def test_demo_reports_identical_parameters(tmp_path):
    result = run("demo.py", "--root", str(tmp_path / "demo"))
    assert "exit status -9" in result.stdout
    assert "resuming from" in result.stdout
    assert "verdict: IDENTICAL" in result.stdout, result.stdout
    assert "DIFFERENT" not in result.stdout
    assert sorted(path.name for path in (tmp_path / "demo").iterdir()) == ["interrupted", "reference"]


def test_demo_under_torchrun_with_two_ranks(tmp_path):
    skip_unless_ranks_fit(2)
    result = run("demo.py", "--root", str(tmp_path / "demo"), "--nproc", "2")
    assert "torchrun --standalone --nproc_per_node=2" in result.stdout
    assert "resuming from" in result.stdout and "nothing to train" not in result.stdout
    assert "verdict: IDENTICAL" in result.stdout, result.stdout


def test_ft_local_kills_a_replica_group_and_heals_it(tmp_path):
    pytest.importorskip("torchft", reason="the ft extra is not installed")
    result = run("ft_local.py", "--root", str(tmp_path / "ft"), timeout=400)
    assert "lighthouse listening on http://127.0.0.1:" in result.stdout
    assert "group 0 trains alone from step" in result.stdout
    healed = re.search(r"healed: step (\d+) -> (\d+) in", result.stdout)
    assert healed and int(healed[1]) < int(healed[2]), result.stdout
    assert "exit codes: {0: 0, 1: 0}" in result.stdout
    assert "replica groups (TorchFT)" in result.stdout and "completed" in result.stdout
