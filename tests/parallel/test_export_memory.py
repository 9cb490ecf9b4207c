"""The export at the end of a sharded run streams (issue 38 point 4): rank 0 gathers one DTensor at a time and writes
it into `model.pth` and `model.safetensors` (and the EMA's shadows into `model-ema.*`) before the next
(`perdure/checkpoints/export_stream.py`), so no rank's resident memory rises during the export by more than a few whole
tensors: measured on a 2-rank FSDP2 run of tests/scripts/meta_llama.py (EXPORT_RSS) with EMA, a ~34 MB model of 1 MB
tensors, with every block of 128 KiB or more its own mapping (MALLOC_MMAP_THRESHOLD_): with glibc's defaults a freed
block stays resident and is reused, and the rise hides in memory the run freed earlier. The files' values are tested
bit for bit by tests/parallel/test_parallel_resume.py (`fsdp2-tp`: pth and safetensors, with EMA), their bytes
against torch.save's and save_file's by tests/test_export_stream.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.runs import assert_all_ok, read_rises, run_dir, run_ranks

DIM, HIDDEN, LAYERS, VOCAB = 256, 1024, 8, 512
MODEL = ("--model.dim", str(DIM), "--model.heads", "4", "--model.hidden", str(HIDDEN), "--model.layers", str(LAYERS))
MODEL += ("--model.vocab", str(VOCAB), "--data.tokens", "200", "--dist.timeout", "60")
MODEL_BYTES = 4 * (2 * VOCAB * DIM + LAYERS * (4 * DIM * DIM + 3 * DIM * HIDDEN + 2 * DIM) + DIM)  # ~34 MB in fp32


@pytest.mark.timeout(300)
def test_no_rank_holds_the_model_while_it_exports(tmp_path):
    assert_all_ok(run_ranks(2, "meta_llama.py", tmp_path / "runs", *MODEL, "--steps", "1", "--ema.enabled", "true",
                            "--ckpt.export_format", "pth,safetensors", EXPORT_RSS=tmp_path / "rss-{rank}",
                            FUSED_STATE="1", MALLOC_MMAP_THRESHOLD_="131072"))  # fmt: skip
    rises = read_rises(tmp_path / "rss-{rank}", 2)
    # measured: 3.1 and 2.2 MB; gathering the whole model and EMA (before): 71 MB on rank 0, 35 MB on rank 1
    assert max(rises) < MODEL_BYTES / 4, f"rises {rises}; model {MODEL_BYTES}"
    directory = run_dir(tmp_path / "runs")
    for name in ("model", "model-ema"):
        pth = torch.load(directory / f"{name}.pth", weights_only=True)
        safetensors = load_file(directory / f"{name}.safetensors")
        assert set(pth) == set(safetensors) and sum(tensor.nbytes for tensor in pth.values()) == MODEL_BYTES
        assert all(torch.equal(pth[key], safetensors[key]) for key in pth)
