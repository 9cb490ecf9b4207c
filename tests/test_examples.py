"""The examples run as a user runs them: `examples/mlp.py` trains, resumes and extends; `examples/demo.py` shows a
SIGKILLed run resuming to bit-identical weights; `examples/nanogpt_char.py` (compiled) and `examples/stream_tokens.py`
(an IterableDataset) resume bit for bit after a SIGKILL; every preset in `configs/` loads into its example;
`examples/ft_local.py` kills a TorchFT replica group and heals it; `examples/self_distill.py` resumes a teacher of its
own bit for bit. Examples whose tests live beside the feature they show: `examples/gpt.py`
(tests/parallel/test_parallel_resume.py), `examples/padded_lm.py` (tests/test_token_loss.py), `examples/llama.py`
(tests/parallel/test_llama.py, test_titan_fit.py), `examples/hf_causal_lm.py` (tests/deepspeed/test_hf_causal_lm.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from perdure.loggers.metrics_csv import read_metrics_csv
from tests import zygote
from tests.runs import GPU_DETERMINISM, built_once, skip_unless_ranks_fit

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def run(script: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PERDURE_", "MLP_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    command = [sys.executable, str(EXAMPLES / script), *args]
    result = zygote.run(command, env=env, capture_output=True, text=True, timeout=timeout)
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


def test_ft_local_gives_each_group_gpus_of_its_own_or_puts_both_on_the_cpu():
    spec = importlib.util.spec_from_file_location("example_ft_local", EXAMPLES / "ft_local.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.group_gpus(0, 1, gpus=0, visible=None) is None  # no GPU: the environment as it is
    assert [example.group_gpus(r, 2, gpus=4, visible=None) for r in (0, 1)] == ["0,1", "2,3"]
    assert [example.group_gpus(r, 1, gpus=2, visible="3, 5") for r in (0, 1)] == ["3", "5"]  # as the user numbered
    assert example.group_gpus(1, 1, gpus=1, visible=None) == ""  # NCCL refuses two ranks on one GPU: the CPU
    assert example.group_gpus(0, 2, gpus=3, visible="0,1,2") == ""


# ---------------------------------------------------------------------- nanogpt_char: a real model, compiled

GPT_ARGS = ("--config", str(CONFIGS / "nanogpt_char-tiny.yaml"), "--steps", "40", "--ckpt.interval", "20")
GPT_ARGS += ("--eval.interval", "20", "--sample.length", "0", "--sched.total_steps", "40")  # a schedule of its own:
# the killed run is given a larger budget (so that it cannot finish before the kill) without changing its curve
GPT_ARGS += GPU_DETERMINISM
THROUGHPUT_COLUMNS = ("step_time", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_mib", "eta")


def start(script: str, *args: str) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PERDURE_", "MLP_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    command = [sys.executable, str(EXAMPLES / script), *args]
    return zygote.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kill_after(process: subprocess.Popen, root: Path, pattern: str, timeout: float = 240) -> None:
    """SIGKILL `process` as soon as `root/<pattern>` exists (a committed checkpoint): a kill at an arbitrary step."""
    deadline = time.monotonic() + timeout
    while not list(root.glob(pattern)):
        assert process.poll() is None, f"ended before {pattern} appeared:\n{process.stdout.read()}"
        assert time.monotonic() < deadline, f"{pattern} never appeared"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    output, _ = process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL, output


def one_run_dir(root: Path) -> Path:
    (found,) = [path.parent for path in root.glob("*/*/checkpoints")]
    return found


def losses(run: Path) -> dict[tuple[int, str], float]:
    rows = read_metrics_csv(run / "metrics.csv")
    return {(step, split): value for step, split, name, value in rows if name == "loss"}


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory):
    root = built_once(
        tmp_path_factory, "gpt-reference", lambda root: run("nanogpt_char.py", "--workspace.root", str(root), *GPT_ARGS)
    )
    return one_run_dir(root)


def test_nanogpt_char_logs_throughput_to_its_log_file(gpt_reference):
    (log,) = (gpt_reference / "logs").glob("*.log")  # written by a process whose output was a pipe, not a terminal
    lines = [line for line in log.read_text().splitlines() if " train: " in line]
    assert len(lines) == 4  # a line every 10 steps
    for line in lines:
        assert all(f" {column} " in line for column in THROUGHPUT_COLUMNS), line
    assert " val: loss " in log.read_text()
    assert set(torch.load(gpt_reference / "model.pth", weights_only=True)) >= {"tok_emb.weight", "head.weight"}


def test_nanogpt_char_compiled_killed_and_resumed_bit_for_bit(gpt_reference, tmp_path):
    # killed at whatever step it reached after its step-20 checkpoint
    kill_after(start("nanogpt_char.py", "--workspace.root", str(tmp_path), *GPT_ARGS, "--steps", "400"), tmp_path,
               "*/*/checkpoints/ckpt-s000000000020/manifest.json")  # fmt: skip
    resumed = run("nanogpt_char.py", "--workspace.root", str(tmp_path), *GPT_ARGS)
    assert "resuming from" in resumed.stdout and "ckpt-s000000000020" in resumed.stdout
    run_path = one_run_dir(tmp_path)
    assert losses(run_path) == losses(gpt_reference)  # every train and val loss, bit for bit
    reference = torch.load(gpt_reference / "model.pth", weights_only=True)
    final = torch.load(run_path / "model.pth", weights_only=True)
    assert reference.keys() == final.keys() and all(torch.equal(reference[k], final[k]) for k in reference)


# ---------------------------------------------------------------------- stream_tokens: an IterableDataset's position

STREAM_ARGS = ("--steps", "40", "--ckpt.interval", "10", "--data.block_size", "256", "--log.interval", "10")
STREAM_ARGS += GPU_DETERMINISM


def test_stream_tokens_resumes_its_stream_where_it_was(tmp_path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    tokens = ("--data.tokens", str(tmp_path / "tokens.u16"))
    run("stream_tokens.py", "--workspace.root", str(reference), *tokens, *STREAM_ARGS)
    kill_after(start("stream_tokens.py", "--workspace.root", str(interrupted), *tokens, *STREAM_ARGS, "--steps",
                     "400"), interrupted, "*/*/checkpoints/ckpt-s000000000020/manifest.json")  # fmt: skip
    resumed = run("stream_tokens.py", "--workspace.root", str(interrupted), *tokens, *STREAM_ARGS)
    assert "resuming from" in resumed.stdout and "restarts its stream" not in resumed.stdout
    run_path = one_run_dir(interrupted)
    position = torch.load(run_path / "checkpoints" / "ckpt-s000000000020" / "rank00000.pth", weights_only=True)
    assert position["data"]["train"]["loader"]["dataset_state"] == {"window": 20 * 32, "passes": 0}
    assert losses(run_path) == losses(one_run_dir(reference))  # across the end of a pass (28 steps each)
    expected = torch.load(one_run_dir(reference) / "model.pth", weights_only=True)
    final = torch.load(run_path / "model.pth", weights_only=True)
    assert all(torch.equal(expected[key], final[key]) for key in expected)


# ---------------------------------------------------------------------- self_distill: state of the program's own

DISTILL_ARGS = ("--steps", "60", "--ckpt.interval", "20", "--log.interval", "20", "--ckpt.async_mode", "thread")


def test_self_distill_resumes_its_teacher_bit_for_bit(tmp_path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    run("self_distill.py", "--workspace.root", str(reference), *DISTILL_ARGS)
    kill_after(start("self_distill.py", "--workspace.root", str(interrupted), *DISTILL_ARGS, "--steps", "4000"),
               interrupted, "*/*/checkpoints/ckpt-s000000000020/manifest.json")  # fmt: skip
    resumed = run("self_distill.py", "--workspace.root", str(interrupted), *DISTILL_ARGS)
    assert "resuming from" in resumed.stdout and "holds no" not in resumed.stdout
    run_path, reference_path = one_run_dir(interrupted), one_run_dir(reference)
    manifest = (run_path / "checkpoints" / "ckpt-s000000000020" / "manifest.json").read_text()
    assert '"teacher"' in manifest
    assert losses(run_path) == losses(reference_path)
    for name in ("model.pth", "teacher.pth"):  # the student, and the teacher that follows it
        expected = torch.load(reference_path / name, weights_only=True)
        final = torch.load(run_path / name, weights_only=True)
        assert expected.keys() == final.keys() and all(torch.equal(expected[k], final[k]) for k in expected), name


# ---------------------------------------------------------------------- configs/: every preset loads


def test_every_preset_in_configs_loads_into_its_example():
    presets = sorted(CONFIGS.glob("*.yaml"))
    assert {path.name for path in presets} >= {"nanogpt_char.yaml", "nanogpt_char-tiny.yaml", "mlp.yaml",
                                                "mlp-tiny.yaml"}  # fmt: skip
    for preset in presets:
        example = preset.stem.removesuffix("-tiny")
        spec = importlib.util.spec_from_file_location(f"example_{example}", EXAMPLES / f"{example}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        config = module.Config().parse(["--config", str(preset)], exit_on_error=False)  # an unknown key raises
        assert config.from_command_line("steps") is False and config.steps is not None


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
    result = zygote.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parallel: tensor 2 (2 ranks)" in result.stdout and "finished at step 10" in result.stdout
    (run_dir,) = [path.parent for path in tmp_path.glob("*/*/checkpoints")]
    weights = torch.load(run_dir / "model.pth", weights_only=True)
    assert weights["layers.0.attn.q.weight"].shape == (32, 32), "the export holds whole tensors under the model's names"
