"""The topology module on its own (pure: no process group): axes, their errors, where a rank sits, its random stream,
and whose rank-local state it continues after a change of topology."""

from __future__ import annotations

import pytest

from perdure import ConfigError, RunnerConfig
from perdure.distributed.topology import Topology


def test_defaults_shard_over_every_rank():
    topology = Topology.resolve(RunnerConfig().parallel.axes, 4)
    assert topology.sizes() == {"replicate": 1, "shard": 4, "tensor": 1, "pipeline": 1, "context": 1, "expert": 1}
    assert topology.mesh_dims() == (("replicate", 1), ("shard", 4))
    assert topology.data_size == 4 and not topology.model_parallel


def test_minus_one_takes_the_rest_and_mesh_keeps_axes_above_one():
    topology = Topology.resolve({"shard": -1, "tensor": 2, "pipeline": 2}, 8)
    assert topology.shard == 2 and topology.world_size == 8
    assert topology.mesh_dims() == (("pipeline", 2), ("replicate", 1), ("shard", 2), ("tensor", 2))
    assert topology.describe() == "pipeline 2 x shard 2 x tensor 2 (8 ranks)"


@pytest.mark.parametrize(
    ("axes", "world_size", "says"),
    [
        ({"shard": 2, "tensor": 2}, 2, "multiply to 4 but the world size is 2"),
        ({"shard": -1, "tensor": 3}, 4, "does not divide the world size 4"),
        ({"shard": -1, "tensor": -1}, 4, "at most one axis may be -1"),
        ({"shard": 0}, 4, "parallel.axes.shard"),
        ({"sequence": 2}, 2, "unknown axis"),
    ],
)
def test_bad_axes_name_the_key_the_product_and_the_world_size(axes, world_size, says):
    with pytest.raises(ConfigError, match="parallel.axes") as error:
        Topology.resolve(axes, world_size)
    assert says in str(error.value)


def test_config_check_refuses_two_free_axes_and_schedule_mismatches():
    config = RunnerConfig()
    config.steps = 1
    with pytest.raises(ConfigError, match="at most one axis may be -1"):
        config.parse(["--parallel.axes.tensor", "-1"], exit_on_error=False)
    config = RunnerConfig()
    config.steps = 1
    with pytest.raises(ConfigError, match="parallel.pipeline.virtual_stages"):
        config.parse(["--parallel.pipeline.schedule", "Interleaved1F1B"], exit_on_error=False)


def test_coordinates_data_ranks_and_streams():
    topology = Topology.resolve({"pipeline": 2, "shard": 2, "tensor": 2}, 8)
    # row-major over pipeline, replicate, shard, context, expert, tensor (as init_device_mesh lays ranks out)
    assert topology.coordinates(5) == {
        "replicate": 0,
        "shard": 0,
        "tensor": 1,
        "pipeline": 1,
        "context": 0,
        "expert": 0,
    }
    assert [topology.rank_at(topology.coordinates(rank)) for rank in range(8)] == list(range(8))
    assert [topology.data_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    # tensor-parallel peers share a stream; data ranks and stages each have their own; rank 0 keeps stream 0
    assert [topology.stream_index(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [topology.stream_leader(rank) for rank in range(8)] == [0, 0, 2, 2, 4, 4, 6, 6]
    assert topology.peers(3, ("shard",)) == [1, 3]


def test_rank_local_state_follows_the_data_rank_and_stage_across_topologies():
    two_by_two = Topology.resolve({"shard": 2, "tensor": 2}, 4)
    shard_two = Topology.resolve({"shard": 2}, 2)
    assert [shard_two.local_source(rank, two_by_two) for rank in range(2)] == [0, 2]
    assert [two_by_two.local_source(rank, two_by_two) for rank in range(4)] == [0, 1, 2, 3]
    assert [Topology.resolve({}, 4).local_source(rank, shard_two) for rank in range(4)] == [0, 1, None, None]
    pipeline = Topology.resolve({"pipeline": 2, "shard": 1}, 2)
    assert Topology.resolve({}, 1).local_source(0, pipeline) == 0


def test_a_manifest_record_from_someone_else_is_checked():
    assert Topology.from_manifest({"shard": 2}) is None
    assert Topology.from_manifest({axis: 1 for axis in ("replicate", "tensor", "pipeline", "context", "expert")}
                                  | {"shard": "2"}) is None  # fmt: skip
    record = Topology.resolve({"shard": 2}, 2).to_manifest()
    assert Topology.from_manifest(record) == Topology(shard=2)
