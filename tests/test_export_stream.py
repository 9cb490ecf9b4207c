"""The streamed export writer (perdure/checkpoints/export_stream.py): the files it writes tensor by tensor are the
bytes `torch.save` and `safetensors.torch.save_file` write for the same dict (save_file's `__metadata__` aside: it
writes those entries in a random order), and a failure half-way leaves no file and still drains the stream."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from perdure.checkpoints.export_stream import Planned, stream_order, write_streamed


def weights():
    generator = torch.Generator().manual_seed(0)
    return {
        "layers.1.weight": torch.randn(3, 5, generator=generator),
        "layers.0.weight": torch.randn(4, 3, generator=generator).to(torch.bfloat16),
        "layers.0.bias": torch.randn(4, generator=generator).to(torch.float16),
        "scale": torch.tensor(2.5, dtype=torch.float64),
        "steps": torch.tensor([7], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "codes": torch.arange(6, dtype=torch.uint8).reshape(2, 3),
        "empty": torch.zeros(0, 4),
        "wide": torch.arange(4).to(torch.uint16),  # a dtype torch.save pickles through _rebuild_tensor_v3
        "quarter": torch.randn(5, generator=generator).to(torch.float8_e4m3fn),
        "a.int": torch.arange(3, dtype=torch.int32),
    }


def plan(state):
    return [Planned(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in state.items()]


def write(tmp_path, formats, state, metadata):
    paths = {fmt: tmp_path / f"model.{fmt}" for fmt in formats}
    ordered = stream_order(plan(state), formats)
    write_streamed(paths, plan(state), (state[entry.name] for entry in ordered), metadata)
    return paths


def split_safetensors(data):
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    return header.pop("__metadata__", None), header, data[8 + length :]


def test_the_streamed_files_are_the_bytes_torch_save_and_save_file_write(tmp_path):
    state = weights()
    expected = io.BytesIO()
    torch.save(state, expected)
    (tmp_path / "pth").mkdir()
    pth = write(tmp_path / "pth", ["pth"], state, {})
    assert pth["pth"].read_bytes() == expected.getvalue()

    (tmp_path / "one").mkdir()
    save_file(state, str(tmp_path / "one" / "reference"), metadata={"format": "pt"})
    one = write(tmp_path / "one", ["safetensors"], state, {"format": "pt"})
    assert one["safetensors"].read_bytes() == (tmp_path / "one" / "reference").read_bytes()

    (tmp_path / "both").mkdir()
    metadata = {"format": "pt", "run": "r-1", "checkpoint": "step-00000010"}
    save_file(state, str(tmp_path / "both" / "reference"), metadata=metadata)
    both = write(tmp_path / "both", ["pth", "safetensors"], state, metadata)
    streamed = split_safetensors(both["safetensors"].read_bytes())
    expected_meta, expected_header, expected_data = split_safetensors((tmp_path / "both" / "reference").read_bytes())
    assert streamed[0] == expected_meta and list(streamed[0]) == sorted(metadata)
    assert json.dumps(streamed[1]) == json.dumps(expected_header) and streamed[2] == expected_data  # in order
    assert len(both["safetensors"].read_bytes()) == len((tmp_path / "both" / "reference").read_bytes())
    for loaded in (torch.load(both["pth"], weights_only=True), load_file(both["safetensors"])):
        assert set(loaded) == set(state)
        for name, tensor in state.items():
            assert loaded[name].dtype == tensor.dtype
            assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert list(torch.load(both["pth"], weights_only=True)) == list(state)  # the dict's order, records as streamed
    assert list(torch.load(both["pth"], weights_only=True, mmap=True)) == list(state)


def test_a_failure_half_way_leaves_no_file_and_drains_the_stream(tmp_path):
    state = weights()
    ordered = stream_order(plan(state), ["pth", "safetensors"])
    taken = []

    def stream():
        for entry in ordered:
            taken.append(entry.name)
            yield state[entry.name] if len(taken) != 3 else state[entry.name].double()  # the third one is wrong

    paths = {"pth": tmp_path / "model.pth", "safetensors": tmp_path / "model.safetensors"}
    with pytest.raises(Exception, match="arrived as torch.float64"):
        write_streamed(paths, plan(state), stream(), {})
    assert taken == [entry.name for entry in ordered]  # every rank's collectives still ran to the end
    assert list(tmp_path.iterdir()) == []
