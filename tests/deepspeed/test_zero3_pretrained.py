"""`--pretrained` into a model built partitioned under ZeRO-3 (`self.init_module()`: `deepspeed.zero.Init`), one tensor
at a time: each rank reads only its partition's part of each parameter (`perdure/runners/zero3_pretrained.py`).

The weights are the `model.safetensors` export of a 1-step torch-stack run of tests/scripts/zero_init_mlp.py (width
3001 with a BatchNorm: 9.07M parameters, 36 MB; odd sizes, so chunks cross rows and the last partitions are padded).
A 2-rank ZeRO-3 launch starts from module weights, buffers and engine fp32 master weights bit-equal to a 1-process
torch-stack `--pretrained` load of the same file; rank 0 reads half the rows; each rank's peak resident memory rises by
less than a quarter of the model over the same launch without `--pretrained` (before, such a load was refused: the
partitioned parameters' shapes are empty); a file with a missing key and a tensor of another shape is refused naming
both, the model's whole shape shown, from its header alone (that tensor's 4 GiB of data are a hole, never read)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from perdure.checkpoints.weights_read import read_weights
from tests.deepspeed.conftest import TIMEOUT
from tests.runs import assert_all_ok, assert_same_weights, built_once, read_rises, run_dir, run_ranks

ARGS = ("--steps", "1", "--dataset_size", "48", "--dataloader.batch_size", "4", "--width", "3001")
ARGS += ("--dist.timeout", "60")
ZERO3 = ("--stack", "deepspeed", "--deepspeed.zero_stage", "3")
ENV = {"NORM": "1"}  # a BatchNorm1d: buffers (running statistics, an int64 count) load too
WIDTH = 3001
# parameters (Linear 16 -> w, BatchNorm, Linear w -> w, Linear w -> 2) and buffers (running mean / var, int64 count)
MODEL_BYTES = 4 * (16 * WIDTH + WIDTH + 2 * WIDTH + WIDTH * WIDTH + WIDTH + 2 * WIDTH + 2 + 2 * WIDTH) + 8


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The reference run's `model.safetensors`, and what a 1-process torch-stack `--pretrained` load of it starts
    from."""

    def build(directory):
        assert_all_ok(run_ranks(1, "zero_init_mlp.py", directory / "reference", *ARGS, "--stack", "torch",
                                "--ckpt.export_format", "safetensors", timeout=TIMEOUT, **ENV))  # fmt: skip
        source = run_dir(directory / "reference") / "model.safetensors"
        assert_all_ok(run_ranks(1, "zero_init_mlp.py", directory / "one", *ARGS, "--stack", "torch",
                                "--pretrained", str(source), SETUP_ONLY="1", INITIAL_WEIGHTS=directory / "one.pt",
                                timeout=TIMEOUT, **ENV))  # fmt: skip

    directory = built_once(tmp_path_factory, "zero3-pretrained", build)
    one_process = torch.load(directory / "one.pt", weights_only=True)["weights"]
    return run_dir(directory / "reference") / "model.safetensors", one_process


@pytest.fixture(scope="module")
def zero3(exported, tmp_path_factory):
    """A 2-rank ZeRO-3 partitioned launch with --pretrained: its initial weights, each rank's peak memory rise, its
    log."""
    source, _ = exported
    path = tmp_path_factory.mktemp("zero3")
    results = run_ranks(2, "zero_init_mlp.py", path / "runs", *ARGS, *ZERO3, "--pretrained", str(source),
                        SETUP_ONLY="1", INITIAL_WEIGHTS=path / "initial.pt", PEAK_RSS=path / "peak-{rank}",
                        timeout=TIMEOUT, **ENV)  # fmt: skip
    assert_all_ok(results)
    peaks = read_rises(path / "peak-{rank}", 2)
    return torch.load(path / "initial.pt", weights_only=True), peaks, results


@pytest.mark.timeout(300)
def test_a_partitioned_model_starts_from_the_weights_one_process_loads(exported, zero3):
    source, one_process = exported
    assert_same_weights(one_process, read_weights(source))  # the export's values (buffers included), loaded whole
    initial, _, results = zero3
    for rank in range(2):
        assert f"rank {rank} holds 0 parameter values once the model is built" in results[rank].stdout
    assert_same_weights(one_process, initial["weights"])  # gathered from the partitions
    parameters = {key: value for key, value in one_process.items() if "running" not in key and "batches" not in key}
    assert_same_weights(parameters, initial["master"])  # the engine's fp32 master copy took them
    # rank 0's rows: half of each parameter's (chunks crossing a row read it whole), and the 24 KB of buffers
    read = f"rank 0 read 18,174,108 of the {MODEL_BYTES:,} bytes of the weights"
    assert read in results[0].stdout, results[0].stdout[-3000:]


@pytest.mark.timeout(300)
def test_a_rank_holds_its_partitions_not_the_file(zero3, tmp_path):
    """How far each rank's resident memory rose from the start of the program to the runner built (engine
    included), over the same launch without --pretrained."""
    _, loaded, _ = zero3
    assert_all_ok(run_ranks(2, "zero_init_mlp.py", tmp_path, *ARGS, *ZERO3, SETUP_ONLY="1",
                            PEAK_RSS=tmp_path / "peak-{rank}", timeout=TIMEOUT, **ENV))  # fmt: skip
    fresh = read_rises(tmp_path / "peak-{rank}", 2)
    for rank in range(2):
        rise = loaded[rank] - fresh[rank]
        assert rise < MODEL_BYTES / 4, f"rank {rank}: {loaded} with, {fresh} without; model {MODEL_BYTES}"


@pytest.mark.timeout(120)
def test_a_file_that_does_not_fit_is_refused_from_its_header(exported, tmp_path):
    """`5.bias` is left out and `3.weight` claims 2^26 x 16 floats (4 GiB, a hole in the file): the refusal names
    both, with the model's whole shape (a partitioned parameter's `ds_shape`), before any tensor data is read."""
    source, _ = exported
    broken = sparse_copy(source, tmp_path / "model.safetensors", drop="5.bias", reshape=("3.weight", [1 << 26, 16]))
    (result,) = run_ranks(1, "zero_init_mlp.py", tmp_path / "runs", *ARGS, *ZERO3, "--pretrained", str(broken),
                          SETUP_ONLY="1", timeout=100, **ENV)  # fmt: skip
    assert result.returncode != 0
    message = (
        f"the weights in {broken} do not fit Sequential: 1 missing: 5.bias; 1 with another shape: "
        f"3.weight (67108864, 16) (model: ({WIDTH}, {WIDTH}))"
    )
    assert message in result.stdout, result.stdout[-3000:]


def sparse_copy(source, target, drop, reshape):
    """`source`'s header without tensor `drop` and with `reshape` = (name, shape), its data a hole of the right size."""
    length = struct.unpack("<Q", source.read_bytes()[:8])[0]
    header = json.loads(source.read_bytes()[8 : 8 + length])
    header.pop("__metadata__", None)
    entries, offset = {}, 0
    for name in sorted(header, key=lambda name: header[name]["data_offsets"][0]):
        if name == drop:
            continue
        entry = dict(header[name])
        if name == reshape[0]:
            entry["shape"] = reshape[1]
        size = {"F32": 4, "I64": 8}[entry["dtype"]] * torch.Size(entry["shape"]).numel()
        entries[name] = {**entry, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(entries).encode()
    with target.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)  # the data: a hole
    return target
