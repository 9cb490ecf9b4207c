"""Every group of a job killed, then the same launch commands again: the job resumes from the latest committed
checkpoint and ends bit-identical to an uninterrupted job. The lighthouse waits for both groups (`--min-replicas 2`),
so every step of both jobs is taken by the same two groups, which makes them comparable; the data of the two groups
is disjoint."""

from __future__ import annotations

import json
import signal

import pytest

from tests.ft.conftest import LIGHTHOUSE_ARGS, start_lighthouse, stop_lighthouse
from tests.ft.groups import assert_same_state, final_state, ft_record, launch, sidecar

pytest.importorskip("torchft", reason="the ft extra is not installed (pip install 'perdure[ft]')")
pytestmark = pytest.mark.timeout(240)

STEPS = 40
ARGS = ("--steps", str(STEPS), "--ckpt.interval", "10", "--dataset_size", "64", "--dataloader.batch_size", "4")


@pytest.fixture(scope="module")
def lighthouse_of_two():
    process, address = start_lighthouse(*LIGHTHOUSE_ARGS, "--min-replicas", "2")
    yield address
    stop_lighthouse(process)


def run_job(tmp_path, lighthouse, name, **env):
    """Both groups of one job, to the end (or their death); returns their exit codes."""
    root = tmp_path / "runs"
    files = {"FINAL_STATE": str(tmp_path / f"{name}{{replica}}.pt"), "LOSS_LOG": str(tmp_path / "losses{replica}")}
    groups = [launch(root, lighthouse, replica, *ARGS, name=name, SAMPLE_LOG="1", **files, **env) for replica in (0, 1)]
    return [code for group in groups for code in group.wait()], groups


def losses(path):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {(r["step"], r["micro"]): (r["loss"], tuple(r["samples"])) for r in records}


def test_every_group_killed_then_relaunched_resumes_bit_exact(tmp_path, lighthouse_of_two):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    reference.mkdir(), interrupted.mkdir()
    codes, _ = run_job(reference, lighthouse_of_two, "final")
    assert codes == [0, 0]

    codes, groups = run_job(interrupted, lighthouse_of_two, "killed", KILL_AT_STEP="25")
    assert codes == [-signal.SIGKILL] * 2, [group.output()[-2000:] for group in groups]
    assert sidecar(interrupted / "runs")["latest_checkpoint"] == "ckpt-s000000000020"
    codes, groups = run_job(interrupted, lighthouse_of_two, "final")
    assert codes == [0, 0], [group.output()[-3000:] for group in groups]

    for replica in (0, 1):
        assert "resuming from" in groups[replica].output() and "(step 20)" in groups[replica].output()
        expected = final_state(reference / f"final{replica}.pt")
        assert_same_state(expected, final_state(interrupted / f"final{replica}.pt"))
        assert not ft_record(interrupted / "runs", replica)["heals"]  # both resumed the checkpoint: nothing to heal
    # The relaunch trained steps 21..40 exactly as the uninterrupted job did, each group from its own random stream.
    for replica in (0, 1):
        expected, got = losses(reference / f"losses{replica}"), losses(interrupted / f"losses{replica}")
        assert {k: v for k, v in got.items() if k[0] >= 20} == {k: v for k, v in expected.items() if k[0] >= 20}
    # The groups read disjoint batches at every step, and together every sample of an epoch (64 = 2 x 8 steps x 4).
    zero, one = losses(reference / "losses0"), losses(reference / "losses1")
    for key in zero:
        assert not set(zero[key][1]) & set(one[key][1]), f"both groups trained on the same samples at step {key}"
    first_epoch = [s for log in (zero, one) for (step, _), (_, samples) in log.items() if step < 8 for s in samples]
    assert sorted(first_epoch) == list(range(64))
    record = sidecar(interrupted / "runs")
    assert record["status"] == "completed" and record["step"] == STEPS
    assert [a["status"] for a in record["attempts"]] == ["interrupted", "interrupted", "completed", "completed"]
