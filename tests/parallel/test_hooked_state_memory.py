"""What state-dict hooks make is held one hooked module at a time on stack=parallel (issue 38): examples/llama.py's
attention splits its sharded fused `wqkv` into whole `wq` / `wk` / `wv` in a state-dict hook (gathering it) and fuses
them back in a load hook. The export and `--pretrained` make the model's state dict piece by piece
(`perdure/checkpoints/state_pieces.py`): the pieces holding the model's own tensors by reference, each hooked
module's state dict made, used and dropped before the next. Before, every rank held every attention's whole `wq` /
`wk` / `wv` at once (the whole state dict made in one call): here 28 MB of a 57 MB model, on every rank. Measured:
the export rose 4.2 and 4.1 MB (before: 30.7 and 30.7 MB), the `--pretrained` launch 6.6 and 6.3 MB over the other
(before: 60.3 and 60.1 MB), the state-dict round-trip check at start-up (`perdure/runners/state_dict_check.py`, piece
by piece too) 4.5 and 4.7 MB (before: 59.2 and 59.2 MB).

A 2-rank FSDP2 run of tests/scripts/meta_llama.py (hooks on, attention-heavy: dim 384, 16 layers) exports model.pth and
model.safetensors; each rank's resident memory rises from the model sharded (PEAK_RSS) to the runner built (BUILT_RSS:
the round-trip check), during the export (EXPORT_RSS) and, in a second launch loading its
model.safetensors with `--pretrained` (a model.pth would be mapped, and the file's pages a rank touches count in its
resident memory), up to the model sharded and loaded (PEAK_RSS) over the first launch's rise at the same point, by less
than half of what the hooks make for the whole model; every block of 128 KiB or more its own mapping
(MALLOC_MMAP_THRESHOLD_: with glibc's defaults a freed block stays resident and hides a later rise). The weights the
second launch starts from (gathered through the hooks) are the export's, bit for bit."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.runs import assert_all_ok, assert_same_weights, read_rises, run_dir, run_ranks

DIM, HIDDEN, LAYERS, VOCAB = 384, 256, 16, 256
MODEL = ("--model.dim", str(DIM), "--model.heads", "8", "--model.hidden", str(HIDDEN), "--model.layers", str(LAYERS))
MODEL += ("--model.vocab", str(VOCAB), "--data.tokens", "200", "--dist.timeout", "60")
MODEL_BYTES = 4 * (2 * VOCAB * DIM + LAYERS * (4 * DIM * DIM + 3 * DIM * HIDDEN + 2 * DIM) + DIM)  # ~57 MB in fp32
HOOK_MADE = 4 * LAYERS * 3 * DIM * DIM  # every attention's whole wq, wk, wv: 28 MB
MMAP = {"MALLOC_MMAP_THRESHOLD_": "131072"}


@pytest.mark.timeout(300)
def test_what_hooks_make_is_held_one_module_at_a_time_in_the_export_and_the_pretrained_load(tmp_path):
    rss = {"PEAK_RSS": tmp_path / "fresh-{rank}", "BUILT_RSS": tmp_path / "built-{rank}"}
    assert_all_ok(run_ranks(2, "meta_llama.py", tmp_path / "runs", *MODEL, "--steps", "1",
                            "--ckpt.export_format", "pth,safetensors", EXPORT_RSS=tmp_path / "export-{rank}",
                            **rss, **MMAP))  # fmt: skip
    built, fresh = read_rises(tmp_path / "built-{rank}", 2), read_rises(tmp_path / "fresh-{rank}", 2)
    check = [after - before for after, before in zip(built, fresh, strict=True)]
    # measured: 4.5 and 4.7 MB (before: 59.2 and 59.2 MB)
    assert max(check) < HOOK_MADE / 2, f"round-trip check rises {check}; the hooks make {HOOK_MADE}"
    export = read_rises(tmp_path / "export-{rank}", 2)
    # measured: 4.2 and 4.1 MB (before: 30.7 and 30.7 MB)
    assert max(export) < HOOK_MADE / 2, f"export rises {export}; the hooks make {HOOK_MADE}, model {MODEL_BYTES}"
    directory = run_dir(tmp_path / "runs")
    exported = torch.load(directory / "model.pth", weights_only=True)
    assert {"layers.0.attention.wq.weight", "layers.15.attention.wv.weight"} <= set(exported)
    assert not any("wqkv" in key for key in exported)
    assert sum(tensor.nbytes for tensor in exported.values()) == MODEL_BYTES
    assert_same_weights(load_file(directory / "model.safetensors"), exported)

    assert_all_ok(run_ranks(2, "meta_llama.py", tmp_path / "loaded", *MODEL, "--pretrained",
                            str(directory / "model.safetensors"), SETUP_ONLY="1", PEAK_RSS=tmp_path / "loaded-{rank}",
                            INITIAL_WEIGHTS=tmp_path / "initial.pt", **MMAP))  # fmt: skip
    loaded = read_rises(tmp_path / "loaded-{rank}", 2)
    rises = [after - before for after, before in zip(loaded, fresh, strict=True)]
    # measured: 6.6 and 6.3 MB (before: 60.3 and 60.1 MB)
    assert max(rises) < HOOK_MADE / 2, f"--pretrained rises {rises}; the hooks make {HOOK_MADE}, model {MODEL_BYTES}"
    initial = torch.load(tmp_path / "initial.pt", weights_only=True)
    assert_same_weights({key: initial[key] for key in exported}, exported)
