"""The parallel stack's torch-level rules on spawned gloo ranks, without a runner or a workspace:

- the device mesh lays ranks out as the topology says; the gradient norm over a 2-D mesh is the whole model's
- the optimizer rebuilt over the sharded parameters keeps its class, groups and options, the scheduler drives it, and
  the parameters really change at a step (a model that does not train is the worst failure)
- a DCP checkpoint of the sharded model and optimizer (shard 2 x tensor 2) loads back bit-identical (Adam's `step`
  included), and reshards with exact values onto shard 2, tensor 2 (the 2-D -> TP-only case reported wrong upstream)
  and one rank
- pipeline schedules: GPipe and 1F1B give bit-identical gradients (why the schedule is not config identity), and a
  stage's rebuilt optimizer trains its parameters
"""

from __future__ import annotations

import io
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from perdure.checkpoints.sharded import ShardedModel, ShardedOptimizer
from perdure.distributed.grad_norm import clip_grad_norm
from perdure.distributed.topology import MESH_NAMES, Topology, device_mesh
from perdure.runners.parallelize import apply_fsdp, find_blocks, mixed_precision_policy
from perdure.runners.pipeline import Pipeline, split_model, stage_indices
from perdure.runners.rebind import parameter_slots, rebind_scheduler, rebuild_optimizer
from tests.distributed.gloo_ranks import run_on_gloo_ranks
from tests.runs import built_once

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from gpt import GPT, TokenLoss  # noqa: E402

pytestmark = pytest.mark.timeout(240)


def whole_model(seed: int = 0) -> tuple[GPT, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The user's side: a whole model, an optimizer with two groups of different options, a scheduler."""
    torch.manual_seed(seed)
    model = GPT(vocab=32, dim=16, heads=2, layers=2, block_size=8, dropout=0.0)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return model, optimizer, scheduler


def sharded(axes: dict[str, int], seed: int = 0):
    """The whole model sharded on `axes` (tensor parallelism by its plan, then FSDP2), its optimizer rebuilt."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # as ParallelRunner does
    model, optimizer, scheduler = whole_model(seed)
    slots = parameter_slots(optimizer, model)
    names = [[slot.name for slot in group] for group in slots]
    topology = Topology.resolve(axes, torch.distributed.get_world_size())
    mesh = device_mesh(topology, "cpu")
    if topology.tensor > 1:
        model.parallelize(mesh)
    policy = mixed_precision_policy("fp32")
    apply_fsdp(model, find_blocks(model), mesh["dp_shard"], mp_policy=policy, offload=False, reshard_after_forward=True)
    rebuilt = rebuild_optimizer(optimizer, slots, [model])
    rebind_scheduler(scheduler, optimizer, rebuilt)
    return model, rebuilt, scheduler, names


def full(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a (flat) state dict, gathered whole."""
    return {key: value.full_tensor() if isinstance(value, DTensor) else value for key, value in state.items()}


def batches(rank: int, count: int = 2):
    generator = torch.Generator().manual_seed(10 + rank)
    return [(torch.randint(0, 32, (4, 8), generator=generator), torch.randint(0, 32, (4, 8), generator=generator))
            for _ in range(count)]  # fmt: skip


def train_and_save(rank: int, world_size: int, path: str) -> dict:
    """shard 2 x tensor 2: mesh layout, rebuilt optimizer, gradient norm, two steps, a DCP save and its round trip."""
    model, optimizer, scheduler, names = sharded({"shard": 2, "tensor": 2})
    mesh = model.layers["0"].attn.q.weight.device_mesh
    report: dict = {"mesh": {axis: mesh[MESH_NAMES[axis]].get_local_rank() for axis in ("shard", "tensor")}}
    report["coordinates"] = Topology.resolve({"shard": 2, "tensor": 2}, 4).coordinates(rank)
    report["groups"] = [
        ({k: v for k, v in group.items() if k != "params"}, len(group["params"])) for group in optimizer.param_groups
    ]
    held = {id(p): n for n, p in model.named_parameters()}
    report["names"] = [[held[id(p)] for p in group["params"]] for group in optimizer.param_groups] == names
    before = full(model.state_dict())
    reference, _, _ = whole_model()
    for step, (inputs, target) in enumerate(batches(rank // 2)):  # tensor peers (ranks 2d, 2d + 1) share batches
        TokenLoss()(model(inputs), target).backward()
        if step == 0:  # the norm over the mesh equals the whole model's, fed both data ranks' batches (averaged)
            for data_rank in (0, 1):
                peer_inputs, peer_target = batches(data_rank)[0]
                (TokenLoss()(reference(peer_inputs), peer_target) / 2).backward()
            norm = clip_grad_norm(list(model.parameters()), None, None)
            expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
            report["norm"] = (float(norm), float(expected))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    after = full(model.state_dict())
    report["changed"] = sorted(name for name in before if not torch.equal(before[name], after[name]))
    report["all"] = sorted(before)
    report["lr"] = [group["lr"] for group in optimizer.param_groups]
    model_view, optimizer_view = ShardedModel([model]), ShardedOptimizer([model], optimizer)
    saved = {"model": full(model_view.state_dict()), "optimizer": full(optimizer_view.state_dict())}
    dcp.save({"model": model_view.state_dict(), "optimizer": optimizer_view.state_dict()}, checkpoint_id=path)
    report["unchanged_by_save"] = all(
        torch.equal(a, b) for a, b in zip(saved["optimizer"].values(), full(optimizer_view.state_dict()).values())
        if isinstance(a, torch.Tensor)
    )  # fmt: skip
    loaded, expected = load(rank, world_size, path, {"shard": 2, "tensor": 2}), _cpu(saved)
    report["round_trip"] = all(same(loaded[part], expected[part]) for part in ("model", "optimizer"))
    report["saved"] = pack(_cpu(saved)) if rank == 0 else None
    return report


def _cpu(state: dict) -> dict:
    return {
        key: {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in part.items()} for key, part in state.items()
    }


def pack(value: object) -> bytes:
    """Tensors go back to the test as bytes (a tensor on the spawn queue is shared through its process, which ends)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=False)  # written by this test's own ranks


def load(rank: int, world_size: int, path: str, axes: dict[str, int]) -> dict:
    """A freshly initialised (other seed) sharded model and optimizer on `axes`, loaded from `path`: full values."""
    model, optimizer, _, _ = sharded(axes, seed=1)
    model_view, optimizer_view = ShardedModel([model]), ShardedOptimizer([model], optimizer)
    template = {"model": model_view.state_dict(), "optimizer": optimizer_view.state_dict()}
    dcp.load(template, checkpoint_id=path)
    model_view.load_state_dict(template["model"])
    optimizer_view.load_state_dict(template["optimizer"])
    return _cpu({"model": full(model_view.state_dict()), "optimizer": full(optimizer_view.state_dict())})


def load_packed(rank: int, world_size: int, path: str, axes: dict[str, int]) -> bytes:
    return pack(load(rank, world_size, path, axes))


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key in a:
        if isinstance(a[key], torch.Tensor):
            if not (isinstance(b[key], torch.Tensor) and a[key].dtype == b[key].dtype and torch.equal(a[key], b[key])):
                return False
        elif a[key] != b[key]:
            return False
    return True


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The 4 ranks' checkpoint and reports, made once for both test workers (20 s of 4 ranks on 2 cores)."""

    def build(directory):
        reports = run_on_gloo_ranks(4, train_and_save, str(directory / "checkpoint"))
        (directory / "reports").write_bytes(pack(reports))

    directory = built_once(tmp_path_factory, "sharded-state", build)
    return str(directory / "checkpoint"), unpack((directory / "reports").read_bytes())


def test_mesh_follows_the_topology_and_the_norm_is_the_whole_models(saved):
    _, reports = saved
    for rank, report in enumerate(reports):
        assert report["mesh"] == {axis: report["coordinates"][axis] for axis in ("shard", "tensor")}, rank
        norm, expected = report["norm"]
        assert norm == pytest.approx(expected, rel=1e-5), rank
    assert len({report["norm"][0] for report in reports}) == 1, "every rank holds the very same norm"


def test_rebuilt_optimizer_keeps_groups_and_options_and_trains_every_parameter(saved):
    _, reports = saved
    for rank, report in enumerate(reports):
        (first, count_first), (second, count_second) = report["groups"]
        assert first["weight_decay"] == 0.1 and second["weight_decay"] == 0.0 and first["initial_lr"] == 1e-2
        assert count_first and count_second and report["names"], "groups hold the same parameters, by name"
        assert report["changed"] == report["all"], f"rank {rank}: parameters that did not train"
        assert report["lr"] == [1e-2 * (1 / 3)] * 2, "the scheduler drives the rebuilt optimizer"


def test_checkpoint_round_trip_is_bit_identical_and_the_save_changes_nothing(saved):
    _, reports = saved
    assert all(report["round_trip"] for report in reports)
    assert all(report["unchanged_by_save"] for report in reports)
    steps = [value for key, value in unpack(reports[0]["saved"])["optimizer"].items() if key.endswith(".step")]
    assert steps and all(float(step) == 2.0 for step in steps)


@pytest.mark.parametrize(
    ("ranks", "axes"),
    [(2, {"shard": 2}), (2, {"shard": 1, "tensor": 2}), (1, {"shard": 1})],
    ids=["shard-2", "tensor-2", "one-rank"],
)
def test_reshard_of_shard_2_x_tensor_2_has_exact_values(saved, ranks, axes):
    path, reports = saved
    expected = unpack(reports[0]["saved"])
    for rank, packed in enumerate(run_on_gloo_ranks(ranks, load_packed, path, axes)):
        loaded = unpack(packed)
        for part in ("model", "optimizer"):
            assert same(loaded[part], expected[part]), f"rank {rank}: {part} after resharding onto {axes}"


def pipeline_schedules(rank: int, world_size: int) -> dict:
    """Two stages: gradients under GPipe and 1F1B, and one optimizer step of the rebuilt stage optimizer."""
    model, optimizer, _ = whole_model()
    slots = parameter_slots(optimizer, model)
    names = [[slot.name for slot in group] for group in slots]
    topology = Topology.resolve({"pipeline": 2, "shard": 1}, 2)
    mesh = device_mesh(topology, "cpu")
    (part,) = split_model(model, stage_indices(rank, 2, 1), 2)
    policy = mixed_precision_policy("fp32")
    apply_fsdp(part, find_blocks(part), mesh["dp_shard"], mp_policy=policy, offload=False, reshard_after_forward=True)
    stage_optimizer = rebuild_optimizer(optimizer, slots, [part])
    inputs, target = batches(0)[0]
    grads, losses = {}, {}
    for schedule in ("GPipe", "1F1B"):
        group = mesh["pp"].get_group()
        pipeline = Pipeline([part], [rank], 2, group=group, last_rank=1, device=torch.device("cpu"),
                            schedule=schedule, microbatches=2, criterion=TokenLoss())  # fmt: skip
        losses[schedule] = float(pipeline.train_window([(inputs, target, 4)]))
        grads[schedule] = {n: p.grad.full_tensor().clone() for n, p in part.named_parameters()}
        stage_optimizer.zero_grad(set_to_none=True)
    pipeline.train_window([(inputs, target, 4)])
    before = {n: p.full_tensor().clone() for n, p in part.named_parameters()}
    stage_optimizer.step()
    return {
        "same_grads": all(torch.equal(grads["GPipe"][n], grads["1F1B"][n]) for n in grads["GPipe"]),
        "losses": losses,
        "held": sorted(before),
        "optimized": sorted(n for group in names for n in group if n in before),
        "changed": sorted(n for n, p in part.named_parameters() if not torch.equal(before[n], p.full_tensor())),
    }


def test_pipeline_schedules_agree_and_a_stage_optimizer_trains_its_parameters():
    reports = run_on_gloo_ranks(2, pipeline_schedules)
    for rank, report in enumerate(reports):
        assert report["same_grads"], f"stage {rank}: GPipe and 1F1B gradients differ"
        assert report["losses"]["GPipe"] == report["losses"]["1F1B"]
        assert report["held"] == report["optimized"] == report["changed"], f"stage {rank}"
    assert not set(reports[0]["held"]) & set(reports[1]["held"])
    assert "tok_emb.weight" in reports[0]["held"] and "head.weight" in reports[1]["held"]
