"""Issue 32, item 1: an *original* DeepSpeed checkpoint that someone else tampered with (a symlink in its engine
folder, a payload `.pt` under a recomputed manifest) is quarantined and the run falls back to the checkpoint before
it, as a file or DCP checkpoint that fails to verify is; nothing it holds runs.

A ZeRO-2 run of 2 ranks is killed at step 12 after its checkpoints at steps 5 and 10; the one of step 10 is tampered
with and the run is continued on 2 ranks.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from perdure.checkpoints.commit import verify_checkpoint
from tests.deepspeed.conftest import ARGS, TIMEOUT
from tests.runs import run_dir, run_ranks
from tests.security.hostile import CodeThatReturns, rewrite_manifest

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")
pytestmark = pytest.mark.timeout(300)

ZERO2 = (*ARGS, "--deepspeed.zero_stage", "2")
OLDER, NEWER = "ckpt-s000000000005", "ckpt-s000000000010"


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepspeed-original") / "runs"
    results = run_ranks(2, "resumable.py", root, *ZERO2, timeout=TIMEOUT, KILL_AT_STEP="12")
    assert [result.returncode for result in results] == [-9, -9], results[0].stdout
    return root


def symlink_in_engine(engine, tmp_path):
    outside = tmp_path / "elsewhere.pt"
    shutil.copy(engine / "mp_rank_00_model_states.pt", outside)
    os.symlink(outside, engine / "extra_states.pt")
    return "is a symlink"


def payload_in_engine(engine, tmp_path):
    states = engine / "mp_rank_00_model_states.pt"
    real = torch.load(states, weights_only=False)  # the test's own file
    torch.save(CodeThatReturns(tmp_path / "PWNED", real), states)
    return "refused DeepSpeed files"


@pytest.mark.parametrize("tamper", [symlink_in_engine, payload_in_engine])
def test_a_tampered_original_is_quarantined_and_the_run_falls_back(two_checkpoints, tmp_path, tamper):
    root = tmp_path / "runs"
    shutil.copytree(two_checkpoints, root, symlinks=True)
    checkpoints = run_dir(root) / "checkpoints"
    reason = tamper(checkpoints / NEWER / "engine", tmp_path)
    rewrite_manifest(checkpoints / NEWER)
    verify_checkpoint(checkpoints / NEWER)  # the manifest is no defence: it verifies

    results = run_ranks(2, "resumable.py", root, *ZERO2, timeout=TIMEOUT)
    out = results[0].stdout + (results[0].stderr or "")
    assert not (tmp_path / "PWNED").exists(), "the payload ran"
    assert [result.returncode for result in results] == [0, 0], out
    assert f"{checkpoints / NEWER}" in out and reason in out
    (quarantined,) = (checkpoints / "quarantine").glob(f"{NEWER}-*")
    assert "refused DeepSpeed files" in (quarantined / "REASON.txt").read_text()
    assert f"resuming from {checkpoints / OLDER} (step 5)" in out
    final = verify_checkpoint(checkpoints / "ckpt-s000000000014")
    assert final["global_step"] == 14
