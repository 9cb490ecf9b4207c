"""`--pretrained` into a model built on the meta device on stack=parallel, shard by shard (issue 38 point 3, issue 34):
each rank reads only the regions of the tensors it holds (`perdure/runners/pretrained_shards.py`).

The weights are the `model.safetensors` export of a 1-step reference run (tests/scripts/meta_llama.py, a ~36 MB Llama).
FSDP2 (2 ranks) and FSDP2 x TP (4 ranks) start from weights bit-equal to a 1-process load of the same file on the
torch stack (the whole file read, then `load_state_dict`); a 2-rank FSDP2 rank's peak resident memory rises by less
than a quarter of the model over the same launch without `--pretrained` (measured: 3.8 and 4.6 MB; reading the whole
file on every rank, as before, rose by 44 and 31 MB); a file with a missing key and a tensor of another shape is
refused naming both, from its header alone: that tensor's 4 GiB of data are a hole in a sparse file, never read;
a sharded `save_pretrained` directory of a Hugging Face Llama loads through the runner's adapter (renamed tensors read
by region, permuted ones computed whole) and the model's own split / fuse hooks; and a DCP checkpoint (`--ckpt.backend
dcp`, `perdure/checkpoints/dcp_slices.py`), written by 1 process or 2 FSDP2 ranks, loads into 2-rank FSDP2 bit-equal
to the whole read, rank 0 reading only the stored chunks that overlap its shards (measured by the reader: its halves
of a 2-rank checkpoint), and one of another width is refused from its `.metadata` alone."""

from __future__ import annotations

import json
import re
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

from perdure.checkpoints.commit import MANIFEST_NAME, hash_file, read_manifest
from perdure.checkpoints.read import read_weights
from tests.runs import assert_all_ok, assert_same_weights, built_once, read_rises, run_dir, run_ranks

COMMON = ("--dist.timeout", "60")
ENV = {"FUSED_STATE": "1"}  # the fused `wqkv` sharded as it is (the model's hooks would gather it whole: see below)
# The peak-resident comparisons: every block of 128 KiB or more its own mapping, so that what is freed leaves the
# resident set at once (with the thresholds the runner holds, freed blocks stay resident until reused).
RSS_ENV = {**ENV, "MALLOC_MMAP_THRESHOLD_": "131072"}
# ~8.9M parameters (36 MB in fp32): big enough that a whole copy of the file shows in a rank's peak memory
MODEL = ("--model.dim", "512", "--model.heads", "8", "--model.hidden", "2048", "--model.layers", "2")
MODEL += ("--model.vocab", "512", "--data.tokens", "200")
MODEL_BYTES = 4 * (512 * 512 * 2 + 2 * (4 * 512 * 512 + 3 * 512 * 2048) + 5 * 512)


def initial_weights(path):
    """The state dict a launch wrote with INITIAL_WEIGHTS (without the RoPE tables, which are no state)."""
    return {key: value for key, value in torch.load(path, weights_only=True).items() if not key.startswith("rope_")}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The reference run's `model.safetensors` (its final DCP checkpoint holds the same weights), and the weights a
    1-process torch-stack `--pretrained` load of it starts from."""

    def build(directory):
        assert_all_ok(run_ranks(1, "meta_llama.py", directory / "reference", *COMMON, *MODEL, "--steps", "1",
                                "--ckpt.export_format", "safetensors", "--ckpt.backend", "dcp", **ENV))  # fmt: skip
        source = run_dir(directory / "reference") / "model.safetensors"
        assert_all_ok(run_ranks(1, "meta_llama.py", directory / "one", *COMMON, *MODEL, "--stack", "torch",
                                "--pretrained", str(source), SETUP_ONLY="1", INITIAL_WEIGHTS=directory / "one.pt",
                                **ENV))  # fmt: skip

    directory = built_once(tmp_path_factory, "pretrained-shards", build)
    return run_dir(directory / "reference") / "model.safetensors", initial_weights(directory / "one.pt")


@pytest.fixture(scope="module")
def fsdp2(exported, tmp_path_factory):
    """A 2-rank FSDP2 launch with --pretrained: its initial weights, each rank's peak memory rise and its log."""
    source, _ = exported
    path = tmp_path_factory.mktemp("fsdp2")
    results = run_ranks(2, "meta_llama.py", path / "runs", *COMMON, *MODEL, "--pretrained", str(source), **RSS_ENV,
                        SETUP_ONLY="1", INITIAL_WEIGHTS=path / "initial.pt", PEAK_RSS=path / "peak-{rank}")  # fmt: skip
    assert_all_ok(results)
    peaks = read_rises(path / "peak-{rank}", 2)
    return initial_weights(path / "initial.pt"), peaks, results[0].stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["fsdp2", "fsdp2-tp"])
def test_a_sharded_meta_model_starts_from_the_weights_one_process_loads(exported, fsdp2, case, tmp_path):
    source, one_process = exported
    assert_same_weights(one_process, read_weights(source))  # the export's values, loaded whole
    if case == "fsdp2":
        weights, _, log = fsdp2
        assert f"rank 0 read {MODEL_BYTES // 2:,} of the {MODEL_BYTES:,} bytes" in log, log[-3000:]  # its halves
    else:
        assert_all_ok(run_ranks(4, "meta_llama.py", tmp_path, *COMMON, *MODEL, "--parallel.axes.tensor", "2",
                                "--pretrained", str(source), SETUP_ONLY="1", INITIAL_WEIGHTS=tmp_path / "initial.pt",
                                **ENV))  # fmt: skip
        weights = initial_weights(tmp_path / "initial.pt")
    assert_same_weights(one_process, weights)


@pytest.mark.timeout(300)
def test_a_rank_holds_its_slices_not_the_file(fsdp2, tmp_path):
    """How far each rank's resident memory rose from the start of the program to the model sharded, materialised
    and loaded, over the same launch without --pretrained."""
    _, loaded, _ = fsdp2
    assert_all_ok(run_ranks(2, "meta_llama.py", tmp_path, *COMMON, *MODEL, SETUP_ONLY="1",
                            PEAK_RSS=tmp_path / "peak-{rank}", **RSS_ENV))  # fmt: skip
    initialised = read_rises(tmp_path / "peak-{rank}", 2)
    for rank in range(2):
        rise = loaded[rank] - initialised[rank]
        assert rise < MODEL_BYTES / 4, f"rank {rank}: {loaded} with, {initialised} without; model {MODEL_BYTES}"


@pytest.mark.timeout(120)
def test_a_file_that_does_not_fit_is_refused_from_its_header(exported, tmp_path):
    """`output.weight` is left out and `tok_embeddings.weight` claims 2^26 x 16 floats (4 GiB, a hole in the file):
    the refusal names both, as a whole-model load's does, before any tensor data is read."""
    source, _ = exported
    length = struct.unpack("<Q", source.read_bytes()[:8])[0]
    header = json.loads(source.read_bytes()[8 : 8 + length])
    header.pop("__metadata__")  # a Hugging Face file: no adapter here, the names are the model's
    tensors = sorted((entry["data_offsets"][0], name) for name, entry in header.items())
    entries, offset = {}, 0
    for _, name in tensors:
        if name == "output.weight":
            continue
        entry = dict(header[name])
        if name == "tok_embeddings.weight":
            entry["shape"] = [1 << 26, 16]
        size = 4 * entry["shape"][0] * (entry["shape"][1] if len(entry["shape"]) > 1 else 1)
        entries[name] = {**entry, "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(entries).encode()
    broken = tmp_path / "model.safetensors"
    with broken.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)) + encoded)
        file.truncate(8 + len(encoded) + offset)  # the data: a hole
    (result,) = run_ranks(1, "meta_llama.py", tmp_path / "runs", *COMMON, *MODEL, "--pretrained", str(broken),
                          SETUP_ONLY="1", timeout=100, **ENV)  # fmt: skip
    assert result.returncode != 0
    message = (
        f"the weights in {broken} do not fit MetaLlama: 1 missing: output.weight; 1 with another shape: "
        "tok_embeddings.weight (67108864, 16) (model: (512, 512))"
    )
    assert message in result.stdout, result.stdout[-3000:]


@pytest.mark.timeout(120)
def test_a_sharded_hugging_face_directory_loads_through_the_adapter_and_the_hooks(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from llama_hf import LlamaStateDictAdapter  # examples/llama_hf.py

    torch.manual_seed(5)  # meta_llama.py's default shapes: vocab 32, dim 16, 2 layers of 2 heads, hidden 32
    settings = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    config = transformers.LlamaConfig(**settings, num_key_value_heads=2, tie_word_embeddings=False)
    published = transformers.LlamaForCausalLM(config)
    published.save_pretrained(tmp_path / "hf", max_shard_size=20_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    results = run_ranks(2, "meta_llama.py", tmp_path / "runs", *COMMON, "--pretrained", str(tmp_path / "hf"),
                        HF_ADAPTER="1", SETUP_ONLY="1", INITIAL_WEIGHTS=tmp_path / "initial.pt")  # fmt: skip
    assert_all_ok(results)
    expected = LlamaStateDictAdapter(2).from_hf(published.state_dict())
    assert_same_weights(expected, initial_weights(tmp_path / "initial.pt"))


@pytest.fixture(scope="module")
def fsdp2_dcp(tmp_path_factory):
    """A 1-step 2-rank FSDP2 run with the DCP backend: its final checkpoint stores each tensor in two halves (dim 0),
    one per rank, as a 2-rank FSDP2 model holds them."""

    def build(directory):
        assert_all_ok(run_ranks(2, "meta_llama.py", directory / "reference", *COMMON, *MODEL, "--steps", "1",
                                "--ckpt.backend", "dcp", **ENV))  # fmt: skip

    return run_dir(built_once(tmp_path_factory, "pretrained-shards-dcp", build) / "reference")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer", ["one-process", "fsdp2"])
def test_a_dcp_checkpoint_loads_shard_by_shard(exported, fsdp2_dcp, writer, tmp_path):
    """`--pretrained RUN_DIR` of a DCP run on a 2-rank FSDP2 model: each rank reads, through DCP's resharding, only
    the stored chunks that overlap its shards, and starts from the weights the whole-read path gives. Written by one
    process (one chunk per tensor: each rank reads every chunk, whole, keeping its half) the weights equal a
    1-process torch-stack load of the same run's export; written by 2 FSDP2 ranks, rank 0 reads its halves alone
    (the bytes the reader took from the shard files: half the weights and each chunk's torch.save framing)."""
    source, one_process = exported
    run = source.parent if writer == "one-process" else fsdp2_dcp
    results = run_ranks(2, "meta_llama.py", tmp_path, *COMMON, *MODEL, "--pretrained", str(run), SETUP_ONLY="1",
                        INITIAL_WEIGHTS=tmp_path / "initial.pt", **ENV)  # fmt: skip
    assert_all_ok(results)
    weights = initial_weights(tmp_path / "initial.pt")
    assert_same_weights(read_weights(run), weights)  # the whole-read path (a torch-stack --pretrained reads this)
    log = results[0].stdout
    found = re.search(rf"rank 0 read ([\d,]+) bytes of its DCP shard files .* for the {MODEL_BYTES:,} bytes", log)
    assert found, log[-3000:]
    read = int(found[1].replace(",", ""))
    if writer == "one-process":
        assert_same_weights(one_process, weights)
        assert MODEL_BYTES < read < MODEL_BYTES * 1.01, read  # every chunk whole
    else:
        assert MODEL_BYTES // 2 < read < MODEL_BYTES // 2 * 1.01, read  # its own chunks only


@pytest.mark.timeout(120)
def test_a_dcp_checkpoint_that_does_not_fit_is_refused_from_its_metadata(exported, tmp_path):
    """A model of another width is refused with the same WeightsMisfitError message as any other form, from the
    DCP `.metadata` alone: the checkpoint's copy has its shard file replaced by zeros (its manifest re-hashed), so a
    tensor read would fail another way."""
    source, _ = exported
    checkpoint = source.parent / "checkpoints" / "ckpt-s000000000001"
    copy = tmp_path / "checkpoints" / checkpoint.name
    shutil.copytree(checkpoint, copy)
    manifest = read_manifest(copy)
    for shard in copy.glob("*.distcp"):
        size = shard.stat().st_size
        with shard.open("r+b") as file:
            file.truncate(0)
            file.truncate(size)  # a hole: zeros
        manifest["files"][shard.name]["digest"] = hash_file(shard).digest
    (copy / MANIFEST_NAME).write_text(json.dumps(manifest))
    (result,) = run_ranks(1, "meta_llama.py", tmp_path / "runs", *COMMON, *MODEL, "--model.dim", "256",
                          "--pretrained", str(copy), SETUP_ONLY="1", timeout=100, **ENV)  # fmt: skip
    assert result.returncode != 0
    message = (
        f"the weights in {copy} do not fit MetaLlama: 17 with another shape: tok_embeddings.weight (512, 512) "
        "(model: (512, 256))"
    )
    assert message in result.stdout, result.stdout[-3000:]
