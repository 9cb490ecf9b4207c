"""The examples run as a user runs them: `examples/mlp.py` trains, resumes and extends; `examples/demo.py` shows a
SIGKILLed run resuming to bit-identical weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def test_gpt_trains_on_one_process(tmp_path):
    result = run("gpt.py", "--workspace.root", str(tmp_path))  # its defaults: 200 steps, a few seconds
    assert "finished at step 200" in result.stdout
    val = [float(line.split("loss ")[1].split()[0]) for line in result.stdout.splitlines() if "val: loss" in line]
    assert val[-1] < 3.0, result.stdout  # log(64) = 4.16 knowing nothing: it learned the bigram table


def test_gpt_under_torchrun_with_tensor_parallelism(tmp_path):
    """The same program on the parallel stack, launched as a user launches it."""
    skip_unless_ranks_fit(2)
    args = ("--workspace.root", str(tmp_path), "--steps", "10", "--ckpt.interval", "5", "--log.interval", "5")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += [str(EXAMPLES / "gpt.py"), "--stack", "parallel", "--parallel.axes.tensor", "2", *args]
    env = {key: value for key, value in os.environ.items() if not key.startswith("PERDURE_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parallel: tensor 2 (2 ranks)" in result.stdout and "finished at step 10" in result.stdout
    (run_dir,) = [path.parent for path in tmp_path.glob("*/*/checkpoints")]
    weights = torch.load(run_dir / "model.pth", weights_only=True)
    assert weights["layers.0.attn.q.weight"].shape == (32, 32), "the export holds whole tensors under the model's names"
