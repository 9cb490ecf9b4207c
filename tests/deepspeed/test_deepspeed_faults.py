"""stack=deepspeed under faults and bad input: SIGTERM to one rank (in a step, and in a ZeRO-3 evaluation), a
non-finite step on one rank, fp16 overflow skips, a raw DeepSpeed setting that contradicts a runner key, a checkpoint
whose pickle would run code, and the export loaded with --pretrained on the torch stack."""

from __future__ import annotations

import csv
import json
import re
import shutil
import signal

import pytest
import torch

from perdure import CheckpointError
from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from perdure.checkpoints.deepspeed_engine import read_deepspeed_weights
from perdure.runners.export import read_weights
from tests.deepspeed.conftest import ARGS, TIMEOUT, args_of
from tests.runs import (
    assert_all_ok,
    assert_ok,
    assert_same_weights,
    final_weights,
    read_losses,
    run,
    run_dir,
    run_ranks,
    start_ranks,
    wait_for_lines,
)
from tests.security.hostile import CodeThatReturns, rewrite_manifest

pytestmark = pytest.mark.timeout(300)


def latest(root):
    checkpoints = run_dir(root) / "checkpoints"
    return checkpoints / read_pointer(checkpoints, "latest")


def test_sigterm_to_rank_one_saves_every_rank_at_the_same_step(references, tmp_path):
    reference, root, args = references("zero2"), tmp_path / "runs", args_of("zero2")
    processes = start_ranks(2, "resumable.py", root, *args, STEP_SLEEP="0.05", LOSS_LOG=tmp_path / "first-{rank}.jsonl")
    wait_for_lines(tmp_path / "first-0.jsonl", 7, processes)
    processes[1].send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [143, 143], outputs
    stopped = int(re.search(r"checkpointing step (\d+)", outputs[0]).group(1))
    assert 0 < stopped < 14
    manifest = verify_checkpoint(latest(root))
    assert manifest["global_step"] == stopped and manifest["reason"] == "preemption" and manifest["world_size"] == 2
    rerun = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")
    assert_all_ok(rerun)
    for rank in range(2):
        expected = read_losses(reference / f"losses-{rank}.jsonl")
        resumed = read_losses(tmp_path / f"rerun-{rank}.jsonl")
        assert min(position[1] for position in resumed) == stopped
        assert all(expected[position] == loss for position, loss in resumed.items()), f"rank {rank} differs"
    assert_same_weights(final_weights(reference), final_weights(root))


def val_losses(root):
    with open(run_dir(root) / "metrics.csv") as file:
        return [(row["step"], row["value"]) for row in csv.DictReader(file) if row["split"] == "val"]


def test_sigterm_to_rank_one_in_an_evaluation_under_zero3_stops_every_rank_and_the_rerun_evaluates_first(
    references, tmp_path
):
    """Under ZeRO-3 an evaluation forward may gather parameters collectively, so ranks must stop an evaluation at the
    same batch: SIGTERM to rank 1 alone during the evaluation of step 5 stops both ranks there (exit 143, step 5
    saved). The rerun evaluates step 5
    first, before any training step (its gathered parameters must stay usable by training: evaluation runs under
    no_grad, not inference mode), and ends bit-equal to the uninterrupted run: losses, weights, evaluations."""
    reference, root, args = references("zero3-ema"), tmp_path / "runs", args_of("zero3-ema")
    eval_log = tmp_path / "eval-0.jsonl"
    processes = start_ranks(2, "resumable.py", root, *args, EVAL_SLEEP="0.3", EVAL_LOG=tmp_path / "eval-{rank}.jsonl")
    wait_for_lines(eval_log, 1, processes)
    processes[1].send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=120)[0] for process in processes]
    assert [process.returncode for process in processes] == [143, 143], outputs
    assert all("evaluation of step 5 stopped at batch" in output for output in outputs), outputs
    assert len(eval_log.read_text().splitlines()) < 5  # 20 validation samples a rank: 5 batches
    manifest = verify_checkpoint(latest(root))
    assert (manifest["global_step"], manifest["reason"]) == (5, "preemption")
    rerun = run_ranks(2, "resumable.py", root, *args, timeout=TIMEOUT, LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")
    assert_all_ok(rerun)
    assert "evaluating step 5, which the last attempt was stopped in" in rerun[0].stdout
    for rank in range(2):
        expected = read_losses(reference / f"losses-{rank}.jsonl")
        resumed = read_losses(tmp_path / f"rerun-{rank}.jsonl")
        assert min(position[1] for position in resumed) == 5
        assert all(expected[position] == loss for position, loss in resumed.items()), f"rank {rank} differs"
    assert_same_weights(final_weights(reference), final_weights(root))
    assert val_losses(root) == val_losses(reference)


def test_zero3_evaluates_an_uneven_split_with_as_many_forwards_on_every_rank(tmp_path):
    """ZeRO-3 gathers each module's parameters at its forward (here every forward: nothing persists or is prefetched),
    a collective: with 41 validation samples rank 0 holds 6 batches and rank 1 five, and the sixth forward waited for
    rank 1 until the collective timed out. Every rank now evaluates 5 batches (the 41st sample is left out)."""
    ds_json = tmp_path / "ds_config.json"
    gather_every_forward = {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0}
    gather_every_forward |= {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 3, **gather_every_forward}}))
    args = (*ARGS, "--steps", "2", "--ckpt.interval", "1", "--deepspeed.zero_stage", "3", "--deepspeed.config", ds_json)
    results = run_ranks(2, "resumable.py", tmp_path / "runs", *args, "--dist.timeout", "30", timeout=TIMEOUT,
                        VAL_SIZE="41", EVAL_LOG=tmp_path / "eval-{rank}.jsonl")  # fmt: skip
    assert_all_ok(results)
    for rank in range(2):
        assert len((tmp_path / f"eval-{rank}.jsonl").read_text().splitlines()) == 2 * 5, f"rank {rank}"
    assert "step 2/2 val: loss" in results[0].stdout


def test_a_non_finite_step_on_one_rank_is_skipped_by_every_rank(tmp_path):
    root = tmp_path / "runs"
    results = run_ranks(2, "resumable.py", root, *ARGS, "--steps", "6", timeout=TIMEOUT, NAN_AT_STEP="3", NAN_RANK="1")
    assert_all_ok(results)
    for result in results:  # rank 0 saw finite gradients of its own: the skip was agreed
        assert "non-finite gradients at step 3: optimizer step skipped (1 skipped so far)" in result.stdout
    assert verify_checkpoint(latest(root))["global_step"] == 6
    assert all(torch.isfinite(tensor).all() for tensor in final_weights(root).values())


def test_fp16_overflow_skips_are_reported_as_skipped_steps_with_a_deepspeed_json_config(tmp_path):
    """One process (the engine gets a process group of one); an existing DeepSpeed JSON file supplies fp16 settings."""
    ds_json = tmp_path / "ds_config.json"
    settings = {"fp16": {"initial_scale_power": 24, "hysteresis": 1}, "zero_optimization": {"stage": 1}}
    ds_json.write_text(json.dumps({**settings, "train_micro_batch_size_per_gpu": "auto"}))
    args = (*ARGS, "--precision", "fp16", "--deepspeed.zero_stage", "1", "--deepspeed.config", str(ds_json))
    # Whatever this CPU's oneDNN offers: the loss scaling under test is DeepSpeed's, the arithmetic torch's own.
    fp16 = {"DS_FP16_SUPPORTED": "1"}
    result = run("resumable.py", tmp_path / "runs", *args, "--steps", "6", timeout=TIMEOUT, **fp16)
    assert_ok(result)
    skipped = re.findall(r"optimizer step skipped \((\d+) skipped so far\)", result.stdout + result.stderr)
    assert skipped and int(skipped[-1]) >= 3, "the loss scale starts far too high: the first steps overflow"
    manifest = verify_checkpoint(latest(tmp_path / "runs"))
    assert manifest["global_step"] == 6 and manifest["world_size"] == 1
    # The run's identity holds the file's path: a file edited before the run is continued is refused, not used.
    settings["fp16"]["loss_scale_window"] = 50
    ds_json.write_text(json.dumps(settings))
    result = run("resumable.py", tmp_path / "runs", *args, "--steps", "8", timeout=TIMEOUT, **fp16)
    assert result.returncode != 0
    assert "was trained with other DeepSpeed settings than this run's: fp16.loss_scale_window: None -> 50" in (
        result.stdout + result.stderr
    )


def test_a_raw_setting_contradicting_a_runner_key_is_refused_before_anything_is_written(tmp_path):
    ds_json = tmp_path / "ds_config.json"
    ds_json.write_text(json.dumps({"gradient_clipping": 1.0, "zero_optimization": {"stage": 2}}))
    result = run("resumable.py", tmp_path / "runs", *ARGS, "--deepspeed.config", str(ds_json), timeout=60)
    assert result.returncode == 2
    assert "config key 'deepspeed.config' = 'gradient_clipping=1.0': contradicts max_grad_norm=None" in result.stderr
    assert not (tmp_path / "runs").exists()


def test_the_export_loads_with_pretrained_on_the_torch_stack_and_reproduces_the_eval_loss(references, tmp_path):
    from perdure.cli.main import main as perdure_cli

    reference = references("zero3-ema")
    exported = final_weights(reference)
    assert_same_weights(exported, read_weights(run_dir(reference)))  # --pretrained RUN_DIR reads the checkpoint
    assert_same_weights(final_weights(reference, "model-ema.pth"), read_weights(run_dir(reference), ema=True))
    assert perdure_cli(["ckpt", "export", str(run_dir(reference)), str(tmp_path / "cli.pth")]) == 0
    assert_same_weights(exported, torch.load(tmp_path / "cli.pth", weights_only=True))
    # The torch stack, 2 ranks, the export as --pretrained, one step at lr 0: its final evaluation sees the same weights
    # and the same validation batches as the reference's last one.
    args = ("--steps", "1", "--optim.lr", "0", "--dataset_size", "48", "--dataloader.batch_size", "4")
    pretrained = ("--pretrained", str(run_dir(reference) / "model.pth"))
    assert_all_ok(run_ranks(2, "resumable.py", tmp_path / "torch", *args, *pretrained, timeout=TIMEOUT))

    def val_loss(root):
        with open(run_dir(root) / "metrics.csv") as file:
            rows = [row for row in csv.DictReader(file) if row["split"] == "val" and row["name"] == "loss"]
        return float(rows[-1]["value"])

    assert val_loss(tmp_path / "torch") == pytest.approx(val_loss(reference), rel=1e-6)


@pytest.mark.parametrize("file", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_a_deepspeed_checkpoint_whose_pickle_runs_code_is_refused(references, tmp_path, file):
    root = tmp_path / "runs"
    shutil.copytree(references("zero2"), root, symlinks=True)
    checkpoint, marker = latest(root), tmp_path / "PWNED"
    target = checkpoint / "engine" / file
    state = torch.load(target, weights_only=False)  # the test's own file
    state["ds_version"] = CodeThatReturns(marker, state["ds_version"])
    torch.save(state, target)
    rewrite_manifest(checkpoint)  # as an attacker would
    with pytest.raises(CheckpointError, match=rf"refused to load {re.escape(str(target))}: .*builtins\.eval"):
        read_deepspeed_weights(checkpoint)  # --pretrained, ckpt export and the export read this way
    if file.startswith("mp_rank"):  # the resume refuses it, quarantines it and falls back to the one before
        result = run_ranks(2, "resumable.py", root, *args_of("zero2"), "--steps", "16", timeout=TIMEOUT)
        output = result[0].stdout
        assert [result[rank].returncode for rank in range(2)] == [0, 0], output
        assert f"refused to load {target}" in output and "builtins.eval" in output, output
        assert f"CHECKPOINT REPAIR: {checkpoint} moved to" in output, output
    assert not marker.exists()


def test_fp16_where_deepspeed_has_no_fp16_is_refused_before_anything_is_written(tmp_path):
    """DeepSpeed's CPU accelerator has fp16 only with oneDNN fp16 kernels (AVX512-FP16 / AMX-FP16): without them the
    engine would fail at construction; the runner says which key to change first."""
    args = (*ARGS, "--precision", "fp16", "--deepspeed.zero_stage", "1", "--steps", "2")
    result = run("resumable.py", tmp_path / "runs", *args, timeout=TIMEOUT, DS_FP16_SUPPORTED="0")
    assert result.returncode != 0
    assert "config key 'precision' = 'fp16': DeepSpeed's cpu accelerator has no fp16 support" in result.stderr
    assert "use precision bf16 or fp32" in result.stderr, result.stderr
    assert not (tmp_path / "runs").exists()
