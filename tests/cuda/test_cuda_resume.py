"""The CUDA path (issue 9), on one GPU: kill -9 + rerun is bit-exact in fp32, bf16 and fp16 with a GradScaler, with
sync, thread and process saves and EMA, the losses a checkpoint carries included (they crashed the first log line
after a resume), a momentum teacher of the program's own and its own collate function; GPU snapshots go through
pinned buffers on a side stream. Skipped where CUDA is not available."""

from __future__ import annotations

import pytest
import torch

from perdure.checkpoints.snapshot import BufferPool, Snapshot
from perdure.checkpoints.staging import Staging
from perdure.loggers.metrics_csv import read_metrics_csv
from perdure.runners.ema import ExponentialMovingAverage
from tests.runs import assert_ok, assert_same_weights, final_weights, read_losses, run, run_dir, run_until_killed
from tests.scripts.resumable import ResumableRunner, make_config

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False): these tests check the GPU path",
    ),
    pytest.mark.timeout(400),
]

# Saves every 5 steps, logs every 4: the checkpoint of step 10 carries the losses of steps 9 and 10.
ARGS = ("--steps", "30", "--width", "256", "--depth", "2", "--ckpt.interval", "5", "--log.interval", "4")
ARGS += ("--ema.enabled", "true", "--deterministic", "true")
# A momentum teacher of the program's own (`self.checkpointed`, kept on the CPU, following the model on the GPU), and a
# collate function of its own whose batches are one flat row (`self.collate_fns`): both resume bit for bit too.
OWN = {"TEACHER": "1", "PACKED": "1"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run of each precision, made on first use."""
    roots = {}

    def get(precision: str):
        if precision not in roots:
            root = tmp_path_factory.mktemp(f"reference-{precision}")
            final = {"LOSS_LOG": root / "losses.jsonl", "FINAL_STATE": root / "final.pt"}
            assert_ok(run("resumable.py", root, *ARGS, "--precision", precision, **OWN, **final))
            roots[precision] = root
        return roots[precision]

    return get


def logged(root):
    """Every train loss and every evaluation's metrics (under no_grad and the precision's autocast) the run logged."""
    rows = read_metrics_csv(run_dir(root) / "metrics.csv")
    wanted = {("train", "loss"), ("train", "lr")}  # not its throughput and memory
    return [
        (step, split, name, value) for step, split, name, value in rows if split == "val" or (split, name) in wanted
    ]


# The async modes with the default staging (a copy on the GPU first: these small models leave room for it), and
# `thread-off`: straight into pinned host buffers, the optimizer step ordered after the copies on the device.
CASES = [(precision, mode) for precision in ("fp32", "bf16", "fp16") for mode in ("disabled", "thread", "process")]


@pytest.mark.parametrize(("precision", "mode"), [*CASES, ("bf16", "thread-off")])
def test_sigkill_and_rerun_is_bit_exact_on_cuda(reference, tmp_path, precision, mode):
    expected_root = reference(precision)
    staging = ("--ckpt.device_staging", "off") if mode.endswith("-off") else ()
    args = (*ARGS, "--precision", precision, "--ckpt.async_mode", mode.removesuffix("-off"), *staging)
    root = tmp_path / "run"
    after_save = "*/*/checkpoints/ckpt-s000000000010/manifest.json"
    sleep = "0.1" if mode == "process" else "0.04"  # the writer process needs ~2 s to start
    killed = run_until_killed("resumable.py", root, *args, when_exists=after_save, STEP_SLEEP=sleep, **OWN)
    assert killed.returncode == -9
    rerun = run(
        "resumable.py", root, *args, LOSS_LOG=tmp_path / "rerun.jsonl", FINAL_STATE=tmp_path / "final.pt", **OWN
    )
    assert_ok(rerun)
    assert "resuming from" in rerun.stdout
    teachers = [
        torch.load(path, weights_only=True)["teacher"] for path in (expected_root / "final.pt", tmp_path / "final.pt")
    ]
    assert teachers[0]["updates"] == teachers[1]["updates"] > 0 and torch.equal(
        teachers[0]["center"], teachers[1]["center"]
    )
    assert_same_weights(teachers[0]["net"], teachers[1]["net"])
    expected, resumed = read_losses(expected_root / "losses.jsonl"), read_losses(tmp_path / "rerun.jsonl")
    assert resumed and min(resumed) > (0, 0, 0)
    for position, loss in resumed.items():
        assert expected[position] == loss, f"loss at {position} differs after the resume"
    # The log lines averaging carried losses included, and the evaluations' metrics.
    assert logged(root) == logged(expected_root) and any(row[1] == "val" for row in logged(root))
    assert_same_weights(final_weights(expected_root), final_weights(root))
    assert_same_weights(final_weights(expected_root, "model-ema.pth"), final_weights(root, "model-ema.pth"))


def test_gpu_snapshots_use_pinned_buffers_and_order_the_step_on_the_device():
    param, statistics = torch.randn(1024, 1024, device="cuda"), torch.randn(64, device="cuda")
    before = param.clone()
    pool = BufferPool(staging=Staging(device_staging="off"))
    snapshot = Snapshot({"param": param, "stats": statistics}, {}, deferred=[param], pool=pool)
    assert all(buffer.is_pinned() for buffer in snapshot.buffers)
    snapshot.fence()
    param.add_(1.0)  # the optimizer step, queued after the copy by the fence
    snapshot.wait()
    assert torch.equal(snapshot.replicated["param"], before.cpu())
    assert torch.equal(snapshot.replicated["stats"], statistics.cpu())
    pool.give_back(snapshot.buffers)
    again = Snapshot({"param": param, "stats": statistics}, {}, deferred=[param], pool=pool)
    assert again.replicated["param"] is snapshot.replicated["param"]  # the pinned buffer is reused
    again.wait()
    assert torch.equal(again.replicated["param"], param.cpu())


def test_a_snapshot_staged_on_the_gpu_needs_no_fence_and_gives_its_device_copy_back():
    param, statistics = torch.randn(4096, 1024, device="cuda"), torch.randn(64, device="cuda")
    before, stats_before = param.clone(), statistics.clone()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    staging = Staging()
    snapshot = Snapshot({"param": param, "stats": statistics}, {}, deferred=[param], pool=BufferPool(staging=staging))
    assert staging.staged_on_device_nbytes == (4096 * 1024 + 64) * 4
    assert all(buffer.is_pinned() for buffer in snapshot.buffers)
    for _ in range(20):  # no fence: the training stream changes both at once, the copies read the device copy
        param.mul_(1.5).add_(1.0)
        statistics.add_(1.0)
    snapshot.wait()
    assert torch.equal(snapshot.replicated["param"], before.cpu())
    assert torch.equal(snapshot.replicated["stats"], stats_before.cpu())
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == allocated, "the device copy was not given back"


def test_no_room_on_the_gpu_means_no_device_copy_and_a_fenced_step():
    param = torch.randn(1024, device="cuda")
    before = param.clone()
    staging = Staging(device_room=lambda device: 1024 * 4 - 1)
    snapshot = Snapshot({"param": param}, {}, deferred=[param], pool=BufferPool(staging=staging))
    assert staging.staged_on_device_nbytes == 0
    snapshot.fence()
    param.add_(1.0)
    snapshot.wait()
    assert torch.equal(snapshot.replicated["param"], before.cpu())


@pytest.mark.parametrize("shared", [False, True])
def test_reserved_buffers_are_pinned_and_a_snapshot_after_them_allocates_nothing(shared):
    param, moment = torch.randn(1024, 1024, device="cuda"), torch.randn(4096, device="cuda")
    pool = BufferPool(shared_memory=shared)
    pool.reserve([param, moment], sets=2)
    assert pool.wait_reserved(120) and pool.reserved_nbytes == 2 * (1024 * 1024 + 4096) * 4
    snapshots = [Snapshot({"p": param, "m": moment}, {}, deferred=[param, moment], pool=pool) for _ in range(2)]
    assert pool.on_demand_nbytes == 0
    for snapshot in snapshots:
        assert all(buffer.is_pinned() and buffer.is_shared() == shared for buffer in snapshot.buffers)
        snapshot.fence()
        snapshot.wait()
        assert torch.equal(snapshot.replicated["p"], param.cpu())
        assert torch.equal(snapshot.replicated["m"], moment.cpu())


def test_buffers_for_a_writer_process_are_shared_and_pinned():
    buffer, pinned = BufferPool(shared_memory=True).take(torch.ones(4096, device="cuda"))
    assert pinned and buffer.is_shared() and buffer.is_pinned()


def test_a_pinning_failure_falls_back_to_pageable_copies(caplog):
    def refuse(shape, dtype, shared):
        raise RuntimeError("out of pinned memory (injected)")

    param = torch.randn(256, device="cuda")
    staging = Staging(allocate_pinned=refuse)
    snapshot = Snapshot({"param": param}, {}, deferred=[param], pool=BufferPool(staging=staging))
    snapshot.fence()
    snapshot.wait()
    assert not snapshot.buffers[0].is_pinned() and torch.equal(snapshot.replicated["param"], param.cpu())
    assert "pinning" in caplog.text and staging.pin is False


class UserEMARunner(ResumableRunner):
    def __init__(self, config):
        super().__init__(config)
        self.ema = ExponentialMovingAverage(self.model, 0.9)  # built before the runner moves the model


def test_an_ema_built_in_init_follows_the_model_to_the_gpu(tmp_path):
    runner = UserEMARunner(make_config(tmp_path, steps=4))
    assert {tensor.device.type for tensor in runner.ema.shadow.values()} == {"cuda"}
    runner.train()
    assert runner.global_step == 4
