"""Kill + rerun on 3 and 4 ranks ends bit-equal to the run that never stopped, with the file and the DCP backend
(issue 17: beyond two ranks a fresh DDP wrap used to reduce the resumed step in another bucket layout, one ulp away).
Every rank SIGKILLs itself at step 12, after the checkpoint of step 10; the rerun of the same command resumes from it.
One uninterrupted reference per world size (the backend does not change the maths)."""

from __future__ import annotations

import signal

import pytest

from tests.runs import assert_all_ok, assert_same_weights, final_weights, read_losses, run_ranks

ARGS = ("--steps", "20", "--ckpt.interval", "5", "--dist.timeout", "60")
ARGS += ("--dataset_size", "96", "--dataloader.batch_size", "4")
TIMEOUT = 150  # seconds one launch of the ranks may take before the test fails

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module", params=[3, 4], ids=lambda ranks: f"{ranks}ranks")
def reference(request, tmp_path_factory):
    ranks = request.param
    root = tmp_path_factory.mktemp(f"reference-{ranks}")
    results = run_ranks(ranks, "resumable.py", root, *ARGS, "--ckpt.backend", "file", timeout=TIMEOUT,
                        LOSS_LOG=root / "losses-{rank}.jsonl")  # fmt: skip
    assert_all_ok(results)
    return ranks, root


@pytest.mark.parametrize("backend", ["file", "dcp"])
def test_sigkill_of_every_rank_and_rerun_is_bit_exact(reference, tmp_path, backend):
    ranks, reference_root = reference
    root, args = tmp_path / "run", (*ARGS, "--ckpt.backend", backend)
    killed = run_ranks(ranks, "resumable.py", root, *args, timeout=TIMEOUT, KILL_AT_STEP="12")
    assert [result.returncode for result in killed] == [-signal.SIGKILL] * ranks, [r.stdout for r in killed]
    rerun = run_ranks(ranks, "resumable.py", root, *args, timeout=TIMEOUT, LOSS_LOG=tmp_path / "rerun-{rank}.jsonl")
    assert_all_ok(rerun)
    assert "resuming from" in rerun[0].stdout and "ckpt-s000000000010" in rerun[0].stdout
    for rank in range(ranks):
        expected = read_losses(reference_root / f"losses-{rank}.jsonl")
        resumed = read_losses(tmp_path / f"rerun-{rank}.jsonl")
        assert resumed and min(resumed) > (0, 10, 0), "the rerun resumed from step 10"
        for position, loss in resumed.items():
            assert expected[position] == loss, f"rank {rank}: loss at {position} differs"
    assert_same_weights(final_weights(reference_root), final_weights(root))
