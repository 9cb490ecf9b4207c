"""`loss.normalize=tokens` (examples/padded_lm.py): the gradient of a window is the sum of the per-token losses over
the whole accumulation window and every data rank divided by the total count of target tokens, as Hugging Face
Trainer's `num_items_in_batch` makes it. Checked against a hand computation on 2 ranks with accumulation 2 and padded
variable-length batches; a killed and rerun run ends bit-equal to an uninterrupted one; a runner that does not count
its tokens, and TorchFT replica groups (which average with equal weights), are refused before anything is written."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from perdure.loggers.metrics_csv import read_metrics_csv
from perdure.runners.rng import seed_everything
from tests import zygote
from tests.runs import (
    assert_all_ok,
    assert_ok,
    assert_same_weights,
    final_weights,
    run,
    run_dir,
    run_ranks,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import padded_lm  # noqa: E402  (examples/padded_lm.py)

# One SGD step with lr 1 over the whole dataset (8 sequences = 2 ranks x 2 micro-batches x 2): weights - gradient.
ONE_STEP = (
    "--data.sequences", "8", "--steps", "1", "--accum_steps", "2", "--dataloader.batch_size", "2",
    "--optim.name", "sgd", "--optim.momentum", "0", "--optim.lr", "1", "--dataloader.shuffle", "false",
)  # fmt: skip


def hand_gradients(config: padded_lm.Config, normalize: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The initial weights of the run and the gradient over its 8 sequences, computed here in one process: `tokens`
    sums every target token's loss and divides by their count; `mean` averages per-sequence means."""
    seed_everything(config.seed)  # as the runner seeds before its __init__ builds the model
    model = padded_lm.TinyCausalLM(config.model.vocab, config.model.dim)
    initial = {name: value.detach().clone() for name, value in model.state_dict().items()}
    data = padded_lm.Sequences(8, config.model.vocab, config.data.min_length, config.data.max_length, 0)
    sums, counts = [], []
    for index in range(len(data)):  # one sequence at a time: no padding at all in the hand computation
        batch = padded_lm.pad_batch([data[index]])
        loss, count = padded_lm.summed_loss(model(batch["input_ids"]), batch["labels"])
        sums.append(loss)
        counts.append(count)
    if normalize == "tokens":
        total = torch.stack(sums).sum() / torch.stack(counts).sum()
    else:
        total = torch.stack([loss / count for loss, count in zip(sums, counts)]).mean()
    total.backward()
    return initial, {name: parameter.grad for name, parameter in model.named_parameters()}


STACKS = {
    "ddp": ("--stack", "torch"),
    "fsdp2": ("--stack", "parallel"),
    "deepspeed-zero3": ("--stack", "deepspeed", "--deepspeed.zero_stage", "3"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_token_weighted_gradient_on_two_ranks_with_accumulation_equals_a_hand_computation(tmp_path, stack):
    if stack.startswith("deepspeed"):
        pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
    assert_all_ok(run_ranks(2, "padded_lm.py", tmp_path, *STACKS[stack], *ONE_STEP, timeout=180))
    trained = final_weights(tmp_path)
    config = padded_lm.Config()
    initial, gradients = hand_gradients(config, "tokens")
    for name, gradient in gradients.items():
        torch.testing.assert_close(trained[name], initial[name] - gradient, rtol=1e-5, atol=1e-6, msg=name)
    # The data make the two normalisations differ: the hand computation above could not pass with a mean of means.
    _, means = hand_gradients(config, "mean")
    assert max((means[name] - gradients[name]).abs().max().item() for name in gradients) > 1e-3


@pytest.mark.timeout(240)
def test_token_weighted_run_killed_and_rerun_ends_bit_equal(tmp_path):
    args = ("--steps", "12", "--ckpt.interval", "5", "--data.sequences", "40", "--log.interval", "4")
    assert_ok(run("padded_lm.py", tmp_path / "reference", *args))
    killed = run("padded_lm.py", tmp_path / "killed", *args, KILL_AT_STEP="7")
    assert killed.returncode == -9, killed.stdout
    rerun = run("padded_lm.py", tmp_path / "killed", *args)
    assert_ok(rerun)
    assert "resuming from" in rerun.stdout and "ckpt-s000000000005" in rerun.stdout
    assert_same_weights(final_weights(tmp_path / "reference"), final_weights(tmp_path / "killed"))
    # Every logged loss (step 4's before the kill; 8 and 12 after, 8 averaging steps 5-8 across the kill) is the same.
    assert losses(tmp_path / "reference") == losses(tmp_path / "killed") != {}


def losses(root: Path) -> dict[int, float]:
    rows = read_metrics_csv(run_dir(root) / "metrics.csv")
    return {step: value for step, split, name, value in rows if (split, name) == ("train", "loss")}


def test_tokens_without_loss_tokens_is_refused_before_anything_is_written(tmp_path):
    program = tmp_path / "no_count.py"
    program.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(padded_lm.__file__).parent)!r})\n"
        "import padded_lm\n"
        "class NoCount(padded_lm.LMRunner):\n"
        "    loss_tokens = padded_lm.Runner.loss_tokens\n"
        "NoCount(padded_lm.Config().parse()).train()\n"
    )
    root = tmp_path / "runs"
    result = zygote.run(
        [sys.executable, str(program), "--workspace.root", str(root)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "loss.normalize" in result.stderr and "override loss_tokens(batch)" in result.stderr, result.stderr
    assert not root.exists() or not any(root.rglob("checkpoints"))


def test_tokens_under_torchft_replica_groups_is_refused_before_anything_is_written(tmp_path):
    pytest.importorskip("torchft", reason="the ft extra is not installed")
    result = run("padded_lm.py", tmp_path, "--ft.enabled", "true", "--ft.lighthouse", "http://127.0.0.1:1")
    assert result.returncode != 0
    assert "'loss.normalize' = 'tokens'" in result.stderr and "TorchFT replica groups" in result.stderr, result.stderr
    assert not any(tmp_path.rglob("checkpoints"))
