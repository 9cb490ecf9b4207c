"""The parts of the TorchFT layer, in this process: config checks, the runner's wiring, the locks, the shared sidecar,
the restricted heal transport and the gradient buckets."""

from __future__ import annotations

import os
import pickle
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from perdure import ConfigError, TorchRunner
from perdure.ft.manager import GradientAverager, HealRefusedError, _transport_class
from perdure.ft.replica import ReplicaRunLock, ReplicaRunningError
from perdure.ft.runner import FaultTolerant
from perdure.ft.telemetry import ReplicaSidecar
from perdure.resilience.run_lock import RunLock, RunLockedError
from perdure.workspace.identity import config_id
from tests import zygote
from tests.runs import environment
from tests.scripts.resumable import Config, ResumableRunner, make_config

pytest.importorskip("torchft", reason="the ft extra is not installed (pip install 'perdure[ft]')")
LIGHTHOUSE = "http://127.0.0.1:29510"


def ft_config(root: Path, **settings) -> Config:
    keys = {"steps": 4, "ft.enabled": True, "ft.group_size": 2, "ft.lighthouse": LIGHTHOUSE, **settings}
    return make_config(root, **keys)


def parse_error(*args: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Config().parse(["--steps", "3", "--ft.enabled", "true", *args], exit_on_error=False)
    return info.value


# ---------------------------------------------------------------------- config


def test_bad_ft_configs_fail_with_the_key_and_the_fix(monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    error = parse_error("--ft.group_size", "2", "--ft.replica_id", "2", "--ft.lighthouse", LIGHTHOUSE)
    assert error.key == "ft.replica_id" and "from 0 to ft.group_size - 1 = 1" in str(error)
    error = parse_error("--ft.group_size", "2")
    assert error.key == "ft.lighthouse" and "perdure ft lighthouse" in str(error)
    error = parse_error("--ft.lighthouse", "127.0.0.1:29510")
    assert error.key == "ft.lighthouse" and "http://HOST:PORT" in str(error)
    error = parse_error("--ft.lighthouse", LIGHTHOUSE, "--ft.min_replica_size", "2")
    assert error.key == "ft.min_replica_size"
    for axis in ("tensor", "pipeline"):  # the parallel stack trains as HSDP across groups: FSDP only inside them
        error = parse_error("--ft.lighthouse", LIGHTHOUSE, "--stack", "parallel", f"--parallel.axes.{axis}", "2")
        assert error.key == f"parallel.axes.{axis}" and "HSDP across replica groups" in str(error)
    Config().parse(["--steps", "3", "--ft.enabled", "true", "--ft.lighthouse", LIGHTHOUSE, "--stack", "parallel"])
    error = parse_error("--ft.lighthouse", LIGHTHOUSE, "--stack", "deepspeed")
    assert error.key == "stack" and "DeepSpeed" in str(error)
    error = parse_error("--ft.lighthouse", LIGHTHOUSE, "--ft.timeout", "0")
    assert error.key == "ft.timeout"
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", LIGHTHOUSE)  # the fallback
    Config().parse(["--steps", "3", "--ft.enabled", "true"], exit_on_error=False)


def test_ft_keys_are_no_part_of_the_run_identity():
    a, b = Config(), Config()
    b.ft.enabled, b.ft.replica_id, b.ft.group_size, b.ft.lighthouse = True, 3, 4, LIGHTHOUSE
    assert config_id(a) == config_id(b)


def test_a_bad_ft_config_writes_nothing(tmp_path):
    with pytest.raises(ConfigError):
        ResumableRunner(ft_config(tmp_path, **{"ft.replica_id": 5}))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_runner_that_subclasses_the_stack_directly_is_refused(tmp_path):
    class Direct(TorchRunner):
        def __init__(self, config):
            super().__init__(config)
            self.model = nn.Linear(2, 2)

    with pytest.raises(ConfigError, match="subclass perdure.Runner"):
        Direct(ft_config(tmp_path))
    assert not any(tmp_path.iterdir())


def test_the_runner_becomes_a_replica_group_and_shards_the_data_over_all_groups(tmp_path):
    runner = ResumableRunner(ft_config(tmp_path, **{"ft.replica_id": 1}))
    try:
        assert isinstance(runner, FaultTolerant) and isinstance(runner, TorchRunner)
        assert runner.data_parallel_rank() == (1, 2)
        sampler = runner.dataloaders["train"].sampler
        assert (sampler.rank, sampler.world_size) == (1, 2)
        evaluation = runner.dataloaders["val"].sampler
        assert (evaluation.rank, evaluation.world_size) == (0, 1)  # every group evaluates the whole split
        assert runner.ft_manager is None  # nothing joins a lighthouse before training starts
        assert not runner.run_dir.path.exists()  # only train() writes
    finally:
        runner.close()


# ---------------------------------------------------------------------- locks


def in_child(action) -> str:
    """Run `action()` in a forked child (locks are per process); returns what it returned, or the error's class."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            result = action()
        except Exception as error:  # noqa: BLE001 - reported to the parent
            result = type(error).__name__
        os.write(write, str(result).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        return pipe.read()


def hold(lock) -> str:
    lock.acquire()
    return "held"


def test_replica_locks_share_the_run_and_exclude_their_own_id(tmp_path, monkeypatch):
    monkeypatch.setattr("perdure.ft.replica.SHARED_WAIT_S", 0.2)
    group0 = ReplicaRunLock(tmp_path, 0)
    group0.acquire()
    try:
        assert in_child(lambda: hold(ReplicaRunLock(tmp_path, 1))) == "held"  # another id is welcome
        assert in_child(lambda: hold(ReplicaRunLock(tmp_path, 0))) == "ReplicaRunningError"
        assert in_child(lambda: hold(RunLock(tmp_path))) == "RunLockedError"  # a plain launch of the run
        with group0.alone() as alone:
            assert alone  # no other group lives: the run lock is exclusive for the repair
            assert in_child(lambda: hold(ReplicaRunLock(tmp_path, 1))) == "RunLockedError"
        assert group0.run.held and group0.run.shared
    finally:
        group0.release()
    plain = RunLock(tmp_path)
    plain.acquire()
    try:
        assert in_child(lambda: hold(ReplicaRunLock(tmp_path, 1))) == "RunLockedError"  # a plain run holds it
    finally:
        plain.release()


def test_a_second_launch_of_a_replica_id_names_the_holder(tmp_path):
    group = ReplicaRunLock(tmp_path, 3)
    group.acquire()
    try:
        message = in_child(lambda: str(pytest.raises(ReplicaRunningError, hold, ReplicaRunLock(tmp_path, 3)).value))
        assert f"replica group 3 of run {tmp_path} is already training (pid {os.getpid()}" in message
        assert (tmp_path / "replica-00003.lock").is_file()
    finally:
        group.release()
    assert issubclass(ReplicaRunningError, RunLockedError)


# ---------------------------------------------------------------------- the shared sidecar


def sidecar_of(run_dir: Path, replica: int) -> ReplicaSidecar:
    identity = dict(run_id="r", lineage="l", code_id="c", config_id="x", hparams={}, tags=[])
    return ReplicaSidecar(run_dir, replica_id=replica, group_size=2, **identity)


def test_groups_share_the_sidecar_without_losing_each_others_records(tmp_path):
    zero, one = sidecar_of(tmp_path, 0), sidecar_of(tmp_path, 1)
    for replica, car in ((0, zero), (1, one)):
        car.start_attempt(
            started=f"2026010{replica}T000000.000000Z", restart_counts={}, resumed_from=None, resumed_step=0,
            details={"replica": replica},
        )  # fmt: skip
        car.write()
    zero.reporting = True
    zero.record(step=5, metrics={"train": {"loss": 1.0}})
    one.record(step=5, metrics={"train": {"loss": 9.0}})  # not the reporter: its progress is not the run's
    one.add_event("heals", {"from_step": 0, "to_step": 5, "seconds": 0.1, "source": "peer"})
    zero.write()
    one.write()
    zero.finish_attempt("completed", "budget reached")
    zero.write()
    data = sidecar_of(tmp_path, 0).to_dict()
    assert [a["replica"] for a in data["attempts"]] == [0, 1]
    assert data["summary"]["train/loss"]["latest"] == 1.0 and data["step"] == 5
    assert data["status"] == "running"  # group 1 still trains
    assert data["ft"]["replicas"]["1"]["heals"][0]["to_step"] == 5
    one.finish_attempt("completed", "budget reached")
    one.write()
    assert sidecar_of(tmp_path, 1).to_dict()["status"] == "completed"
    # A restarted group 1 marks its own earlier attempt interrupted, never group 0's.
    again = sidecar_of(tmp_path, 1)
    again.start_attempt(started="20260103T000000.000000Z", restart_counts={}, resumed_from=None, resumed_step=5,
                        details={"replica": 1})  # fmt: skip
    again.write()
    statuses = [(a["replica"], a["status"]) for a in sidecar_of(tmp_path, 0).to_dict()["attempts"]]
    assert statuses == [(0, "completed"), (1, "completed"), (1, "running")]


# ---------------------------------------------------------------------- heals and gradients


class Foreign:
    """A class no allow-list knows."""


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_a_heal_takes_tensors_and_plain_data_only_and_owns_its_tensors():
    transport = _transport_class()(timedelta(seconds=10), host="127.0.0.1", ip="127.0.0.1")
    try:
        state = {"model": {"w": torch.ones(3)}, "state": {"global_step": 7, "results": {"7": {"val": {"loss": 0.5}}}}}
        transport.send_checkpoint(dst_ranks=[1], step=7, state_dict=state, timeout=timedelta(seconds=10))
        received = transport.recv_checkpoint(0, transport.metadata(), 7, timedelta(seconds=10))
        assert received["state"] == state["state"] and torch.equal(received["model"]["w"], torch.ones(3))
        received["model"]["w"].add_(1)  # writable: the optimizer updates healed state in place
        transport.send_checkpoint(dst_ranks=[1], step=8, state_dict={"x": Foreign()}, timeout=timedelta(seconds=10))
        with pytest.raises(HealRefusedError, match="Foreign"):
            transport.recv_checkpoint(0, transport.metadata(), 8, timedelta(seconds=10))
    finally:
        transport.shutdown()
    assert pickle.loads(pickle.dumps(Foreign()))  # a class that pickles fine: only the allow-list refused it


class Halving:
    """A stand-in for the manager: 'averages' with an absent peer whose gradients are zero."""

    def allreduce(self, tensor):
        tensor.div_(2)
        return self

    def wait(self):
        return True


def test_gradients_travel_in_fixed_buckets_and_a_missing_gradient_takes_part():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
    parameters = list(model.parameters())
    averager = GradientAverager(parameters, bucket_bytes=80)  # 20 floats: weight (16) + bias (4), then weight (16)
    assert [[tuple(p.shape) for p in bucket] for bucket in averager.buckets] == [[(4, 4), (4,)], [(4, 4)]]
    parameters[0].grad = torch.full((4, 4), 2.0)
    averager.average(Halving())
    assert torch.equal(parameters[0].grad, torch.ones(4, 4))
    assert torch.equal(parameters[1].grad, torch.zeros(4)) and torch.equal(parameters[2].grad, torch.zeros(4, 4))


SHARDS_SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from perdure.ft.manager import HealRefusedError, local_shards, sharded_like
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
template = {"w": DTensor.from_local(torch.zeros(4, 3), mesh, [Shard(0)]), "step": 7, "b": torch.zeros(2)}
sent = local_shards({"w": DTensor.from_local(torch.ones(4, 3), mesh, [Shard(0)]), "step": 8, "b": torch.ones(2)})
assert type(sent["w"]) is torch.Tensor and sent["step"] == 8
back = sharded_like(template, sent)
assert isinstance(back["w"], DTensor) and back["w"].placements == (Shard(0),)
assert torch.equal(back["w"].to_local(), sent["w"])
assert type(back["b"]) is torch.Tensor and back["step"] == 8
try:
    sharded_like(template, {"w": torch.ones(5, 3)})
except HealRefusedError as error:
    print("refused:", error)
dist.destroy_process_group()
"""


def test_heal_shards_go_back_into_the_sharded_layout_and_a_misshapen_one_is_refused():
    result = zygote.run([sys.executable, "-c", SHARDS_SCRIPT], env=environment(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert (
        "refused: a peer sent a shard of [5, 3] torch.float32 where this rank holds [4, 3] torch.float32"
        in result.stdout
    )
