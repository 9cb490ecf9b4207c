"""The device path's rules that a CPU can check (issue 9's audit): batches of any container type reach the device,
saved CUDA generator states go back to the right device whatever the number of visible GPUs, EMA shadows follow the
model. The GPU itself is exercised in tests/cuda/."""

from __future__ import annotations

import collections

import torch
from torch import nn

from perdure.runners.ema import ExponentialMovingAverage
from perdure.runners.rng import cuda_states_to_restore
from tests.scripts.resumable import ResumableRunner, make_config

Batch = collections.namedtuple("Batch", "input target")


def test_to_device_keeps_every_container_type(tmp_path):
    runner = ResumableRunner(make_config(tmp_path, steps=1))
    try:
        batch = {"pair": Batch(torch.ones(2), torch.zeros(2)), "list": [torch.ones(1)], "text": "kept"}
        moved = runner.to_device(batch)
        assert isinstance(moved["pair"], Batch) and torch.equal(moved["pair"].target.cpu(), torch.zeros(2))
        assert moved["pair"].target.device == moved["list"][0].device == runner.device
        assert isinstance(moved["list"], list) and moved["text"] == "kept"
        inputs, target = runner.unpack_batch(Batch(torch.ones(3), torch.zeros(3)))
        assert inputs.device == target.device == runner.device
    finally:
        runner.close()


def test_saved_cuda_generators_go_to_the_device_the_run_trains_on():
    states = [torch.full((16,), index, dtype=torch.uint8) for index in range(4)]
    # The same number of visible devices: every generator back to its own index.
    assert [device for device, _ in cuda_states_to_restore(states, 2, 4, 2)] == [0, 1, 2, 3]
    # Rank 2 saved with the whole node visible, resumes seeing only its own GPU (index 0 now).
    [(device, state)] = cuda_states_to_restore(states, 2, 1, 0)
    assert device == 0 and torch.equal(state, states[2])
    # An older checkpoint that does not say which device it trained on, on another number of devices: nothing.
    assert cuda_states_to_restore(states, None, 1, 0) == []


def test_ema_shadows_follow_the_model_to_its_device():
    model = nn.Linear(3, 2)
    ema = ExponentialMovingAverage(model, 0.5)
    assert ema.to(torch.device("meta")) is ema
    assert {tensor.device.type for tensor in ema.weights().values()} == {"meta"}
