"""What state-dict hooks make is held one hooked module at a time on stack=parallel (issue 38): examples/llama.py's
attention splits its sharded fused `wqkv` into whole `wq` / `wk` / `wv` in a state-dict hook (gathering it) and fuses
them back in a load hook. `--pretrained`, the state-dict round-trip check at start-up and the export make the model's
state dict piece by piece (`perdure/checkpoints/state_pieces.py`): the pieces holding the model's own tensors by
reference, each hooked module's state dict made, used and dropped before the next. Before, every rank held every
attention's whole `wq` / `wk` / `wv` at once (the whole state dict made in one call): here 28 MB of a 57 MB model.

One 2-rank FSDP2 launch of tests/scripts/meta_llama.py (hooks on, attention-heavy: dim 384, 16 layers) starts from a
safetensors file the test writes in the hooks' layout, trains one step and exports model.pth, model.safetensors and
the Hugging Face directory (hf/, without an adapter: streamed like model.safetensors, perdure/runners/hf_export.py).
Each rank's resident memory rises, by less than half of what the hooks make for the whole model: while `--pretrained`
is read into its shards (LOAD_RSS), from the model sharded to the runner built (the round-trip check: BUILT_RSS), during
the export (EXPORT_RSS); every block of 128 KiB or more its own mapping (MALLOC_MMAP_THRESHOLD_: with
glibc's defaults a freed block stays resident and hides a later rise). The weights the run starts from (gathered
through the hooks) are the file's, bit for bit. Measured: the load rose 5.9 and 5.7 MB (before: 60.4 and 60.5 MB), the
check 4.4 and 4.4 MB (before: 59.3 and 59.4 MB), the export 4.2 and 4.1 MB (before: 30.9 and 30.7 MB); with hf/ in
the same export 4.2 and 4.4 MB (before: 59.0 and 113.1 MB: the whole state dict made on every rank for DCP's Hugging
Face writer); hf/model.safetensors holds model.pth's tensors. A second, smaller launch exports hf/ through a
state-dict adapter."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.runs import assert_all_ok, assert_same_weights, read_rises, run_dir, run_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import llama  # noqa: E402  (examples/llama.py)
from llama_hf import LlamaStateDictAdapter  # noqa: E402  (examples/llama_hf.py)

from tests.scripts.meta_llama import ConcatNormsAdapter  # noqa: E402

DIM, HIDDEN, LAYERS, VOCAB, SEQ = 384, 256, 16, 256, 8
MODEL = ("--model.dim", str(DIM), "--model.heads", "8", "--model.hidden", str(HIDDEN), "--model.layers", str(LAYERS))
MODEL += ("--model.vocab", str(VOCAB), "--model.seq_len", str(SEQ), "--data.tokens", "200", "--dist.timeout", "60")
MODEL_BYTES = 4 * (2 * VOCAB * DIM + LAYERS * (4 * DIM * DIM + 3 * DIM * HIDDEN + 2 * DIM) + DIM)  # ~57 MB in fp32
HOOK_MADE = 4 * LAYERS * 3 * DIM * DIM  # every attention's whole wq, wk, wv: 28 MB
MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def hooked_weights() -> dict[str, torch.Tensor]:
    """Random weights under the names and shapes the model's state dict gives them (its hooks applied)."""
    with torch.device("meta"):
        model = llama.Llama(VOCAB, DIM, LAYERS, 8, HIDDEN, SEQ, 10000.0)
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(value.shape, generator=generator) for name, value in model.state_dict().items()}


@pytest.mark.timeout(300)
def test_what_hooks_make_is_held_one_module_at_a_time(tmp_path):
    weights = hooked_weights()
    assert {"layers.0.attention.wq.weight", "layers.15.attention.wv.weight"} <= set(weights)
    assert sum(tensor.nbytes for tensor in weights.values()) == MODEL_BYTES
    save_file(weights, tmp_path / "weights.safetensors")
    rss = {name: tmp_path / f"{name.lower()}-{{rank}}" for name in ("LOAD_RSS", "BUILT_RSS", "EXPORT_RSS")}
    assert_all_ok(run_ranks(2, "meta_llama.py", tmp_path / "runs", *MODEL, "--steps", "1",
                            "--pretrained", str(tmp_path / "weights.safetensors"),
                            "--ckpt.export_format", "pth,safetensors,hf", INITIAL_WEIGHTS=tmp_path / "initial.pt",
                            HF_CONFIG="1", **rss, **MMAP))  # fmt: skip
    load, check, export = (read_rises(path, 2) for path in rss.values())
    assert max(load) < HOOK_MADE / 2, f"--pretrained rises {load}; the hooks make {HOOK_MADE}"
    assert max(check) < HOOK_MADE / 2, f"round-trip check rises {check}; the hooks make {HOOK_MADE}"
    assert max(export) < HOOK_MADE / 2, f"export rises {export}; the hooks make {HOOK_MADE}"
    initial = torch.load(tmp_path / "initial.pt", weights_only=True)
    assert_same_weights({key: initial[key] for key in weights}, weights)
    directory = run_dir(tmp_path / "runs")
    exported = torch.load(directory / "model.pth", weights_only=True)
    assert {key: value.shape for key, value in exported.items()} == {key: value.shape for key, value in weights.items()}
    assert_same_weights(load_file(directory / "model.safetensors"), exported)
    assert_same_weights(load_file(directory / "hf" / "model.safetensors"), exported)


SMALL = ("--model.dim", "256", "--model.heads", "8", "--model.hidden", "128", "--model.layers", "8")
SMALL += ("--model.vocab", "256", "--model.seq_len", "8", "--data.tokens", "200", "--dist.timeout", "60")
SMALL_HOOK_MADE = 4 * 8 * 3 * 256 * 256  # every attention's whole wq, wk, wv: 6.3 MB


@pytest.mark.timeout(300)
def test_the_hugging_face_export_through_a_key_wise_adapter_streams_what_hooks_make(tmp_path):
    """hf/ through examples/llama_hf.py's adapter (renames, permutes q and k: each key mapped alone) streams as
    without one, one hooked module at a time, each tensor mapped alone (`hf_export.stream_adapted`); an adapter that
    concatenates two keys (`ConcatNormsAdapter`, a second export of the same launch) takes the whole path (DCP's
    writer, what the hooks make whole on every rank) and says so. Both equal the adapter's `to_hf` of model.pth.
    Measured (EXPORT_RSS, EXPORT_AGAIN_RSS): the export with model.pth and hf/ rose 1.9 and 1.8 MB; the whole path
    13.6 and 24.2 MB, as the export through this adapter did before."""
    again = tmp_path / "hf-concat"
    results = run_ranks(2, "meta_llama.py", tmp_path / "runs", *SMALL, "--steps", "1", "--ckpt.export_format", "pth,hf",
                        HF_CONFIG="1", HF_ADAPTER="1", EXPORT_RSS=tmp_path / "export-{rank}", EXPORT_AGAIN=again,
                        EXPORT_AGAIN_RSS=tmp_path / "again-{rank}", **MMAP)  # fmt: skip
    assert_all_ok(results)
    streamed = read_rises(tmp_path / "export-{rank}", 2)
    assert max(streamed) < SMALL_HOOK_MADE / 2, f"export rises {streamed}; the hooks make {SMALL_HOOK_MADE}"
    warned = [line for line in results[0].stdout.splitlines() if "maps keys together" in line]
    assert len(warned) == 1 and "ConcatNormsAdapter" in warned[0], warned
    weights = torch.load(run_dir(tmp_path / "runs") / "model.pth", weights_only=True)
    heads = 8
    published = load_file(run_dir(tmp_path / "runs") / "hf" / "model.safetensors")  # streamed: one file
    assert_same_weights(published, LlamaStateDictAdapter(heads).to_hf(weights))
    concatenated = {}
    for file in again.glob("*.safetensors"):
        concatenated.update(load_file(file))
    assert_same_weights(concatenated, ConcatNormsAdapter(heads).to_hf(weights))
