"""Issue 32, items 1 and 4: a DeepSpeed checkpoint handed over by someone else cannot run code or write outside the
run through DeepSpeed's universal form (the one perdure makes to resume on another number of ranks).

A ZeRO-2 run of 2 ranks is killed after its checkpoint at step 5; a run of 1 rank then continues it from the
universal form. The tampering is an attacker's: manifests recomputed, payloads that would return the real data so
that training went on normally.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from perdure.checkpoints.commit import verify_checkpoint
from perdure.checkpoints.deepspeed_universal import derived_path
from perdure.checkpoints.safe_unpickle import load_deepspeed_file
from perdure.safe_io import regular_files_under
from tests.deepspeed.conftest import ARGS, TIMEOUT
from tests.runs import run_dir, run_ranks
from tests.security.hostile import CodeThatReturns, rewrite_manifest

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
pytestmark = pytest.mark.timeout(300)

ZERO2 = (*ARGS, "--deepspeed.zero_stage", "2")
CHECKPOINT = "ckpt-s000000000005"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A ZeRO-2 run of 2 ranks SIGKILLed at step 7: its latest checkpoint (step 5) was written by 2 ranks."""
    root = tmp_path_factory.mktemp("deepspeed-victim") / "runs"
    results = run_ranks(2, "resumable.py", root, *ZERO2, timeout=TIMEOUT, KILL_AT_STEP="7")
    assert [result.returncode for result in results] == [-9, -9], results[0].stdout
    return root


def copy_of(two_ranks, tmp_path):
    root = tmp_path / "runs"
    shutil.copytree(two_ranks, root, symlinks=True)
    return root, run_dir(root) / "checkpoints" / CHECKPOINT


def test_a_symlinked_universal_folder_runs_nothing_and_is_converted_again(two_ranks, tmp_path):
    root, checkpoint = copy_of(two_ranks, tmp_path)
    (first,) = run_ranks(1, "resumable.py", root, *ZERO2, timeout=TIMEOUT, KILL_AT_STEP="7")  # keeps the universal form
    assert first.returncode == -9, first.stdout
    derived = derived_path(checkpoint)
    folder = derived / "engine" / "zero" / "0.weight"
    assert (folder / "fp32.pt").is_file()

    # the folder of one parameter replaced by a symlink to a folder outside holding a payload
    marker, outside = tmp_path / "PWNED", tmp_path / "elsewhere"
    shutil.copytree(folder, outside)
    real = torch.load(folder / "fp32.pt", weights_only=True)
    torch.save(CodeThatReturns(marker, real), outside / "fp32.pt")
    shutil.rmtree(folder)
    os.symlink(outside, folder)
    rewrite_manifest(derived)
    verify_checkpoint(derived)  # the manifest is no defence: it verifies

    (second,) = run_ranks(1, "resumable.py", root, *ZERO2, "--steps", "6", timeout=TIMEOUT)
    assert not marker.exists(), "the payload ran"
    assert second.returncode == 0, second.stdout
    assert f"refused the universal form {derived}" in second.stdout and "is a symlink" in second.stdout
    assert "converting it to DeepSpeed's universal checkpoint format" in second.stdout  # fell back to the original
    quarantined = list((derived.parent / "quarantine").glob(f"{CHECKPOINT}-*"))
    assert len(quarantined) == 1 and os.path.islink(quarantined[0] / "engine" / "zero" / "0.weight")
    assert "refused universal form" in (quarantined[0] / "REASON.txt").read_text()
    assert regular_files_under(derived)  # the fresh conversion: no symlink anywhere
    assert verify_checkpoint(run_dir(root) / "checkpoints" / "ckpt-s000000000006")["world_size"] == 1


def test_a_parameter_name_that_is_a_path_writes_nothing_outside(two_ranks, tmp_path):
    root, checkpoint = copy_of(two_ranks, tmp_path)
    outside = tmp_path / "outside" / "evil"
    optim = checkpoint / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = load_deepspeed_file(optim)
    (mapping,) = state["optimizer_state_dict"]["param_slice_mappings"]
    mapping[str(outside)] = mapping.pop("0.bias")  # DeepSpeed's converter: os.path.join(output, name, ...)
    torch.save(state, optim)
    rewrite_manifest(checkpoint)

    (result,) = run_ranks(1, "resumable.py", root, *ZERO2, "--steps", "6", timeout=TIMEOUT)
    assert not (tmp_path / "outside").exists(), "the conversion wrote outside its directory"
    assert result.returncode == 0, result.stdout  # refused, quarantined, and trained from the start (nothing older)
    assert f"refused DeepSpeed checkpoint file {optim}" in result.stdout and "plain path component" in result.stdout
    assert not derived_path(checkpoint).exists()
    (quarantined,) = (checkpoint.parent / "quarantine").glob(f"{CHECKPOINT}-*")
    assert "plain path component" in (quarantined / "REASON.txt").read_text()
