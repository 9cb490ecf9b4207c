"""ZeRO-3 with EMA: no rank holds the whole model or the whole EMA while a checkpoint is saved or the export is
written (issue 38 point 4). The checkpoint's EMA shadows are gathered one at a time and written by rank 0 into
`ema.pth` (`StreamedState`, perdure/checkpoints/deepspeed_engine.py), the export's fp32 master weights and shadows
likewise into model.pth / model-ema.pth (`DeepSpeedRunner._streamed_fp32_weights`). Measured on a 2-rank run of
tests/scripts/zero_init_mlp.py (CHECKPOINT_RSS, EXPORT_RSS): 26 x Linear(512, 512), 27 MB in fp32, every block of
128 KiB or more its own mapping (MALLOC_MMAP_THRESHOLD_; with glibc's defaults a freed block stays resident and the
rise hides in memory the run freed before): the checkpoint rose 2.3 and 2.3 MB, the export 2.0 and 2.0 MB; before,
35 and 27 MB (the whole shadows all-gathered on every rank, pickled into each rank's engine file) and 53 and 27 MB
(the whole weights on rank 0, then the whole shadows on every rank). The Hugging Face export of the EMA (`hf-ema/`)
streams its shadows the same way (before, every rank gathered the whole EMA for it: 27 MB more each). Both go through
a key-wise state-dict adapter (ADAPTER=keywise: each key mapped alone through `to_hf`, `hf_export.stream_adapted`):
the export rose 3.7 and 2.2 MB; through an adapter that concatenates two keys (ADAPTER=concat, the whole path, as
every adapter did before) 53.3 and 2.2 MB. The values are
tested bit for bit by tests/deepspeed/test_zero_init.py (killed and resumed: model.pth, model-ema.pth) and
test_deepspeed_world_size.py (the EMA on another world size).

What state-dict hooks make is exported one hooked module at a time (`perdure/runners/zero3_export.py`): with SPLIT_STATE
each hidden Linear saves its weight as two new tensors (its halves, cloned); each one's fp32 master weights are gathered
and its hooks run before the next's. The export rose 3.6 and 3.6 MB; before, 78.1 and 2.0 MB (the whole weights
gathered on rank 0, then the model's state dict made from them through every hook at once). Its values are the
checkpoint's master weights as DeepSpeed's zero-to-fp32 routine reads them from the files, split as the hook splits
them. The Hugging Face export of the same launch (`hf/`, perdure/runners/hf_export.py) streams from the same source
and holds model.pth's tensors bit for bit (before, it made the module's state dict on the partitions in one call:
the hook split the empty partitions, and the export held an empty tensor for each half)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from perdure.checkpoints.deepspeed_engine import read_deepspeed_weights
from tests.runs import assert_all_ok, read_rises, run_dir, run_ranks
from tests.scripts.zero_init_mlp import KeywiseAdapter

WIDTH, DEPTH = 512, 24
ARGS = ("--stack", "deepspeed", "--deepspeed.zero_stage", "3", "--ema.enabled", "true", "--steps", "1")
ARGS += ("--dataset_size", "8", "--dataloader.batch_size", "4", "--dist.timeout", "60", "--ckpt.interval", "1")
ARGS += ("--width", str(WIDTH), "--depth", str(DEPTH))
MODEL_BYTES = 4 * (16 * WIDTH + WIDTH + (DEPTH + 1) * (WIDTH * WIDTH + WIDTH) + 2 * WIDTH + 2)


@pytest.mark.timeout(300)
def test_no_rank_holds_the_model_or_the_ema_while_it_saves_or_exports(tmp_path):
    """The Hugging Face exports go through a key-wise state-dict adapter (zero_init_mlp.py's `KeywiseAdapter`:
    renames, permutes, splits), streamed one tensor at a time, each mapped alone: the files hold its `to_hf` of
    model.pth / model-ema.pth (what the whole path wrote) bit for bit."""
    results = run_ranks(2, "zero_init_mlp.py", tmp_path / "runs", *ARGS, "--ckpt.export_format", "pth,hf",
                        HF_CONFIG="1", ADAPTER="keywise", CHECKPOINT_RSS=tmp_path / "ckpt-{rank}",
                        EXPORT_RSS=tmp_path / "export-{rank}", MALLOC_MMAP_THRESHOLD_="131072")  # fmt: skip
    assert_all_ok(results)
    assert not [result for result in results if "maps keys together" in result.stdout]
    checkpoint = read_rises(tmp_path / "ckpt-{rank}", 2)
    export = read_rises(tmp_path / "export-{rank}", 2)
    assert max(export) < MODEL_BYTES / 4, f"export rises {export}; model {MODEL_BYTES}"
    assert max(checkpoint) < MODEL_BYTES / 4, f"checkpoint rises {checkpoint}; model {MODEL_BYTES}"
    directory = run_dir(tmp_path / "runs")
    for name, hf in (("model.pth", "hf"), ("model-ema.pth", "hf-ema")):
        weights = torch.load(directory / name, weights_only=True)
        assert sum(tensor.nbytes for tensor in weights.values()) == MODEL_BYTES
        published = load_file(directory / hf / "model.safetensors")  # streamed like model.pth, one tensor at a time
        mapped = KeywiseAdapter().to_hf(weights)
        assert set(published) == set(mapped) and all(torch.equal(published[key], mapped[key]) for key in mapped)


@pytest.mark.timeout(300)
def test_what_hooks_make_is_exported_one_hooked_module_at_a_time(tmp_path):
    """model.pth and the Hugging Face export (`hf/`) of a model whose hooks split each hidden weight in two."""
    args = [arg for arg in ARGS if arg not in ("--ema.enabled", "true")]
    assert_all_ok(run_ranks(2, "zero_init_mlp.py", tmp_path / "runs", *args, "--ckpt.export_format", "pth,hf",
                            SPLIT_STATE="1", HF_CONFIG="1", EXPORT_RSS=tmp_path / "export-{rank}",
                            MALLOC_MMAP_THRESHOLD_="131072"))  # fmt: skip
    export = read_rises(tmp_path / "export-{rank}", 2)
    assert max(export) < MODEL_BYTES / 4, f"export rises {export}; model {MODEL_BYTES}"
    directory = run_dir(tmp_path / "runs")
    exported = torch.load(directory / "model.pth", weights_only=True)
    expected = read_deepspeed_weights(directory / "checkpoints" / "ckpt-s000000000001")
    for index in range(2, 2 + 2 * DEPTH, 2):  # the hidden Linears: nn.Sequential's items 2, 4, ...
        top, bottom = expected.pop(f"{index}.weight").chunk(2)
        expected[f"{index}.weight_top"], expected[f"{index}.weight_bottom"] = top, bottom
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[key], expected[key]) for key in expected)
    published = load_file(directory / "hf" / "model.safetensors")
    assert set(published) == set(exported)
    assert all(torch.equal(published[key], exported[key]) for key in exported)
