"""stack=parallel, killed and rerun: every rank SIGKILLs itself at step 7 (after the checkpoint of step 5); the rerun of
the same command ends with losses and exported weights bit-equal to an uninterrupted run. The killed run's checkpoint
is also resumed on other topologies (resharding): those finish, and within the interrupted epoch every sample is read
exactly once. One uninterrupted reference per topology; a tiny GPT (2 blocks, width 16) from examples/gpt.py."""

from __future__ import annotations

import collections
import json
import shutil
import signal

import pytest

from perdure.checkpoints.commit import read_pointer, verify_checkpoint
from tests.runs import (
    assert_all_ok,
    assert_same_weights,
    built_once,
    final_weights,
    read_losses,
    run_dir,
    run_ranks,
)

STEPS = ("--stack", "parallel", "--steps", "10", "--dist.timeout", "60")
TRAIN_SAMPLES = 64  # tests/scripts/parallel_gpt.py: 64 training windows
TIMEOUT = 150  # seconds one launch may take

pytestmark = pytest.mark.timeout(600)

# name: (ranks, the axes, other options: the same in a resume on another topology, so that it continues the run)
TOPOLOGIES = {
    "fsdp2": (2, (), ()),
    "fsdp2-tp": (
        4,
        ("--parallel.axes.tensor", "2"),
        ("--ema.enabled", "true", "--ckpt.export_format", "pth,safetensors"),
    ),
    "pipeline-1f1b": (2, ("--parallel.axes.pipeline", "2"), ()),
    "pipeline-3-stages": (
        3,
        ("--parallel.axes.pipeline", "3"),
        ("--model.layers", "3", "--dataloader.batch_size", "6", "--dataloader.drop_last", "true")
        + ("--ema.enabled", "true"),
    ),
    "fsdp2-bf16-ac-compile": (
        2,
        (),
        ("--precision", "bf16", "--parallel.activation_checkpointing", "true")
        + ("--compile.enabled", "true", "--compile.backend", "aot_eager"),
    ),
}
# case: (killed topology, ranks of the resume, its axes): the resharding cases of issue 10
RESHARDS = {
    "fsdp2-to-1": ("fsdp2", 1, ()),
    "fsdp2-to-4": ("fsdp2", 4, ()),
    "fsdp2-tp-to-shard-2": ("fsdp2-tp", 2, ()),
    "fsdp2-tp-to-1": ("fsdp2-tp", 1, ()),
    "pipeline-to-1": ("pipeline-1f1b", 1, ()),
}
EXPORTS = {"fsdp2-tp": ("model.pth", "model-ema.pth"), "pipeline-3-stages": ("model.pth", "model-ema.pth")}


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Per topology: an uninterrupted reference, and a run killed at step 7 (its run dir, copied before any rerun)."""

    def build(name, base):
        ranks, axes, options = TOPOLOGIES[name]
        reference = run_ranks(ranks, "parallel_gpt.py", base / "reference", *STEPS, *axes, *options,
                              timeout=TIMEOUT, LOSS_LOG=base / "reference-{rank}.jsonl")  # fmt: skip
        assert_all_ok(reference)
        first = run_ranks(ranks, "parallel_gpt.py", base / "killed", *STEPS, *axes, *options, timeout=TIMEOUT,
                          KILL_AT_STEP="7", SAMPLE_LOG=base / "samples-{rank}.jsonl")  # fmt: skip
        assert [result.returncode for result in first] == [-signal.SIGKILL] * ranks, [r.stdout for r in first]
        checkpoints = run_dir(base / "killed") / "checkpoints"
        assert read_pointer(checkpoints, "latest") == "ckpt-s000000000005"
        manifest = verify_checkpoint(checkpoints / "ckpt-s000000000005")
        assert manifest["backend"] == "dcp" and manifest["world_size"] == ranks
        assert sum(size > 1 for size in manifest["topology"].values()) >= (1 if ranks > 1 else 0)

    # Built once for both test workers (a 4-rank topology's two runs take 40 s): read only, each test copies it.
    return lambda name: built_once(tmp_path_factory, f"parallel-{name}", lambda base: build(name, base))


def copy_run(base, name, tmp_path):
    """A copy of the killed run's workspace, so that each resume starts from the same checkpoint."""
    root = tmp_path / name
    shutil.copytree(base / "killed", root, symlinks=True)
    return root


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_kill_every_rank_and_rerun_is_bit_exact(killed, tmp_path, name):
    ranks, axes, options = TOPOLOGIES[name]
    base = killed(name)
    root = copy_run(base, "rerun", tmp_path)
    rerun = run_ranks(ranks, "parallel_gpt.py", root, *STEPS, *axes, *options, timeout=TIMEOUT,
                      LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")  # fmt: skip
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout and "ckpt-s000000000005" in rerun[0].stdout
    assert "TOPOLOGY CHANGE" not in rerun[0].stdout
    for rank in range(ranks):
        expected = read_losses(base / f"reference-{rank}.jsonl")
        resumed = read_losses(tmp_path / f"rerun-{rank}.jsonl")
        assert sorted(step for _, step, _ in resumed) == list(range(5, 10)), "the rerun trained steps 5 to 9"
        for position, loss in resumed.items():
            assert expected[position] == loss, f"rank {rank}: loss at {position} differs"
    for export in EXPORTS.get(name, ("model.pth",)):
        assert_same_weights(final_weights(base / "reference", export), final_weights(root, export))
    if "safetensors" in options:
        from safetensors.torch import load_file

        assert_same_weights(final_weights(root), load_file(run_dir(root) / "model.safetensors"))


def read_samples(path, keep):
    seen = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record["epoch"] == 0 and keep(record["step"]):
            seen.extend(record["samples"])
    return seen


@pytest.mark.parametrize("case", list(RESHARDS))
def test_resume_on_another_topology_reads_every_sample_once(killed, tmp_path, case):
    name, ranks, axes = RESHARDS[case]
    options = TOPOLOGIES[name][2]
    base = killed(name)
    root = copy_run(base, "resharded", tmp_path)
    # enough steps to finish the interrupted epoch on any of these topologies (16 steps per epoch on 1 data rank)
    resumed = run_ranks(ranks, "parallel_gpt.py", root, *STEPS, "--steps", "16", *axes, *options, timeout=TIMEOUT,
                        SAMPLE_LOG=tmp_path / "samples-{rank}.jsonl")  # fmt: skip
    assert_all_ok(resumed)
    assert "resuming from" in resumed[0].stdout and "(step 5)" in resumed[0].stdout
    (change,) = [line for line in resumed[0].stdout.splitlines() if "TOPOLOGY CHANGE" in line]
    assert f"({ranks} rank" in change
    manifest = verify_checkpoint(run_dir(root) / "checkpoints" / "ckpt-s000000000016")
    assert manifest["world_size"] == ranks and manifest["topology"]["shard"] == ranks
    before = []
    for path in base.glob("samples-*.jsonl"):
        before += read_samples(path, lambda step: step < 5)  # what the checkpoint of step 5 had consumed
    after = []
    for path in tmp_path.glob("samples-*.jsonl"):
        after += read_samples(path, lambda step: True)
    counts = collections.Counter(before + after)
    assert sorted(counts) == list(range(TRAIN_SAMPLES)) and set(counts.values()) == {1}, counts
    weights = final_weights(root)
    assert "layers.0.attn.q.weight" in weights and all(value.isfinite().all() for value in weights.values())
