"""The checkpoint writer process of ckpt.async_mode=process dies: killed while writing (the out-of-memory killer's
SIGKILL), its save fails with the real cause, the next save starts another writer, and the run ends bit-equal to one
that never lost its writer; a writer that cannot start is not restarted, each save says why, and the run exits (it
never hangs on what it had queued for the dead process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from perdure.checkpoints.commit import verify_checkpoint
from perdure.checkpoints.resolve import committed_checkpoints
from tests.runs import assert_ok, assert_same_weights, built_once, final_weights, run, run_dir

pytestmark = pytest.mark.timeout(240)

ARGS = ("--steps", "40", "--ckpt.interval", "10", "--width", "64", "--depth", "2", "--ckpt.async_mode", "process")
SLOW = "0.1"  # the writer process needs ~2 s to start: saves land after it is up


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return built_once(tmp_path_factory, "writer-reference", lambda root: assert_ok(run("resumable.py", root, *ARGS)))


def test_a_writer_killed_while_writing_fails_that_save_and_the_next_starts_another(reference, tmp_path):
    root = tmp_path / "run"
    # Each save writes state.pth and rank00000.pth: the 3rd write is the second save's first file.
    result = run("resumable.py", root, *ARGS, STEP_SLEEP=SLOW, WRITER_FAULT="write:3", WRITER_FAULT_DONE=tmp_path / "x")
    output = result.stdout + result.stderr
    assert_ok(result)
    failed = re.search(r"checkpoint (ckpt-s\d+) \(interval\) failed: the checkpoint writer process was killed by "
                       r"SIGKILL \(the out-of-memory killer sends it: see `dmesg`\) while writing \1; the next save "
                       r"starts another", output)  # fmt: skip
    assert failed, output
    assert "starting a new checkpoint writer process: the last one ended (exit -9)" in output
    checkpoints = run_dir(root) / "checkpoints"
    committed = [path.name for path in committed_checkpoints(checkpoints)]
    assert "ckpt-s000000000040" in committed and failed.group(1) not in committed
    assert not list(checkpoints.glob(".tmp-*"))
    for name in committed:
        verify_checkpoint(checkpoints / name)
    assert_same_weights(final_weights(reference), final_weights(root))


def test_a_writer_that_cannot_start_is_not_restarted_and_the_run_exits(tmp_path):
    result = run("resumable.py", tmp_path, *ARGS, STEP_SLEEP=SLOW, WRITER_FAULT="import",
                 WRITER_FAULT_DONE=tmp_path / "x", timeout=120)  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ImportError: this writer process cannot start (injected by the test)" in result.stderr
    assert "starting a new checkpoint writer process" not in result.stdout + result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert re.match(r"error: checkpoint ckpt-s000000000040 \(\w+\) failed: the checkpoint writer process died (before "
                    r"this save|while writing ckpt-s000000000040) \(exit 1; its error is above\)\. It must be able to "
                    r"import the training script", last), last  # fmt: skip
    assert not committed_checkpoints(run_dir(tmp_path) / "checkpoints")
