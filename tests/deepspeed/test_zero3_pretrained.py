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
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from perdure.checkpoints.read import read_weights
from tests.deepspeed.conftest import TIMEOUT
from tests.runs import assert_all_ok, assert_same_weights, built_once, read_rises, run_dir, run_ranks

ARGS = ("--steps", "1", "--dataset_size", "48", "--dataloader.batch_size", "4", "--width", "3001")
ARGS += ("--dist.timeout", "60")
ZERO3 = ("--stack", "deepspeed", "--deepspeed.zero_stage", "3")
ENV = {"NORM": "1"}  # a BatchNorm1d: buffers (running statistics, an int64 count) load too
# The peak-resident comparisons: every block of 128 KiB or more its own mapping, so that what is freed leaves the
# resident set at once (glibc's thresholds held at 32 / 64 MiB, as the runner holds them, keep freed blocks resident
# until they are reused: the peak then says how the heap was laid out, not what the load held).
RSS_ENV = {**ENV, "MALLOC_MMAP_THRESHOLD_": "131072"}
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
                        timeout=TIMEOUT, **RSS_ENV)  # fmt: skip
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
                            PEAK_RSS=tmp_path / "peak-{rank}", timeout=TIMEOUT, **RSS_ENV))  # fmt: skip
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


HOOKED_WIDTH, HOOKED_DEPTH = 512, 24
HOOKED_MODEL_BYTES = 4 * (16 * HOOKED_WIDTH + HOOKED_WIDTH + (HOOKED_DEPTH + 1) * (HOOKED_WIDTH**2 + HOOKED_WIDTH))
HOOKED_MODEL_BYTES += 4 * (2 * HOOKED_WIDTH + 2)


def split_weights() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(random weights in the layout SPLIT_STATE's and RENAME_STATE's hooks save: each hidden Linear's weight as
    `weight_top` and `weight_bottom`, the next Linear's as `kernel`; the same weights keyed by parameter, the halves
    joined): the file, and what loading it whole gives."""
    width, generator = HOOKED_WIDTH, torch.Generator().manual_seed(0)
    shapes = {"0.weight": (width, 16), "0.bias": (width,)}
    for index in range(2, 2 * HOOKED_DEPTH + 2, 2):  # the hidden Linears (nn.Sequential's items 2, 4, ...)
        shapes.update({f"{index}.weight_top": (width // 2, width), f"{index}.weight_bottom": (width // 2, width)})
        shapes[f"{index}.bias"] = (width,)
    last = 2 * HOOKED_DEPTH + 2
    shapes.update({f"{last}.kernel": (width, width), f"{last}.bias": (width,)})
    shapes.update({f"{last + 2}.weight": (2, width), f"{last + 2}.bias": (2,)})
    saved = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    whole = {name: tensor for name, tensor in saved.items() if not name.endswith(("_top", "_bottom", "kernel"))}
    whole[f"{last}.weight"] = saved[f"{last}.kernel"]
    for index in range(2, 2 * HOOKED_DEPTH + 2, 2):
        whole[f"{index}.weight"] = torch.cat([saved[f"{index}.weight_top"], saved[f"{index}.weight_bottom"]])
    return saved, whole


@pytest.mark.timeout(300)
def test_weights_a_hook_splits_load_into_partitions_one_hooked_module_at_a_time(tmp_path):
    """SPLIT_STATE's 24 hidden Linears save their weight split in two new tensors and join them back in a load hook;
    RENAME_STATE's next Linear saves its weight as `kernel` (a hook that makes no tensor: each rank reads its
    partitions under that name). Each hooked Linear's parameters are gathered whole for its hooks (names and shapes
    checked, then loaded through them), one at a time; the model starts from the file's weights joined, bit for bit
    (module and master copy), and a rank's resident memory rises by far less than the model while it loads (LOAD_RSS).
    Before, the hooks ran on the empty partitions and the load was refused."""
    saved, whole = split_weights()
    assert sum(tensor.nbytes for tensor in saved.values()) == HOOKED_MODEL_BYTES
    source = tmp_path / "weights.safetensors"
    save_file(saved, source)
    args = ("--steps", "1", "--dataset_size", "8", "--dataloader.batch_size", "4", "--dist.timeout", "60", *ZERO3)
    args += ("--width", str(HOOKED_WIDTH), "--depth", str(HOOKED_DEPTH))
    results = run_ranks(2, "zero_init_mlp.py", tmp_path / "runs", *args, "--pretrained", str(source), SETUP_ONLY="1",
                        SPLIT_STATE="1", RENAME_STATE="1", INITIAL_WEIGHTS=tmp_path / "initial.pt",
                        LOAD_RSS=tmp_path / "load-{rank}", MALLOC_MMAP_THRESHOLD_="131072",
                        timeout=TIMEOUT)  # fmt: skip
    assert_all_ok(results)
    initial = torch.load(tmp_path / "initial.pt", weights_only=True)
    assert_same_weights(whole, initial["weights"])
    assert_same_weights(whole, initial["master"])
    load = read_rises(tmp_path / "load-{rank}", 2)
    assert max(load) < HOOKED_MODEL_BYTES / 4, f"--pretrained rises {load}; model {HOOKED_MODEL_BYTES}"


@pytest.mark.timeout(300)
def test_a_fused_qkv_llama_built_partitioned_starts_from_pretrained_and_exports_hf_through_its_adapter(tmp_path):
    """examples/llama.py under ZeRO-3 `init_module`: each attention holds a fused `wqkv`, which its state-dict hooks
    save as `wq` / `wk` / `wv` (made whole) and fuse back. Its hooks run on its parameters gathered whole, one
    attention at a time: the start-up round-trip check (before, on the empty partitions: "size mismatch for
    wqkv.weight ... torch.Size([48, 0])"), --pretrained (a torch.save file in the hooks' layout) and the Hugging Face
    export through the runner's adapter (key-wise: each tensor gathered and mapped alone through `to_hf`).
    One step at lr 0: model.pth is the file bit for bit, hf/ is the adapter's `to_hf` of it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import llama  # examples/llama.py
    from llama_hf import LlamaStateDictAdapter  # examples/llama_hf.py

    with torch.device("meta"):
        model = llama.Llama(32, 16, 2, 2, 32, 8, 10000.0)  # meta_llama.py's defaults, 2 layers
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(value.shape, generator=generator) for name, value in model.state_dict().items()}
    assert "layers.1.attention.wk.weight" in weights
    torch.save(weights, tmp_path / "weights.pth")  # a safetensors file would be read as Hugging Face's, via from_hf
    args = (*ZERO3, "--steps", "1", "--optim.lr", "0", "--model.layers", "2", "--dist.timeout", "60")
    assert_all_ok(run_ranks(2, "meta_llama.py", tmp_path / "runs", *args, "--pretrained",
                            str(tmp_path / "weights.pth"), "--ckpt.export_format", "pth,hf", HF_ADAPTER="1",
                            HF_CONFIG="1", timeout=TIMEOUT))  # fmt: skip
    directory = run_dir(tmp_path / "runs")
    assert_same_weights(torch.load(directory / "model.pth", weights_only=True), weights)
    assert_same_weights(load_file(directory / "hf" / "model.safetensors"), LlamaStateDictAdapter(2).to_hf(weights))
