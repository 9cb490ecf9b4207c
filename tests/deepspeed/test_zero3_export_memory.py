"""ZeRO-3 with EMA: no rank holds the whole model or the whole EMA while a checkpoint is saved or the export is
written (issue 38 point 4). The checkpoint's EMA shadows are gathered one at a time and written by rank 0 into
`ema.pth` (`StreamedState`, perdure/checkpoints/deepspeed_engine.py), the export's fp32 master weights and shadows
likewise into model.pth / model-ema.pth (`DeepSpeedRunner._streamed_fp32_weights`). Measured on a 2-rank run of
tests/scripts/zero_init_mlp.py (CHECKPOINT_RSS, EXPORT_RSS): 26 x Linear(512, 512), 27 MB in fp32, every block of
128 KiB or more its own mapping (MALLOC_MMAP_THRESHOLD_; with glibc's defaults a freed block stays resident and the
rise hides in memory the run freed before): the checkpoint rose 2.3 and 2.3 MB, the export 2.0 and 2.0 MB; before,
35 and 27 MB (the whole shadows all-gathered on every rank, pickled into each rank's engine file) and 53 and 27 MB
(the whole weights on rank 0, then the whole shadows on every rank). The values are tested bit for bit by
tests/deepspeed/test_zero_init.py (killed and resumed: model.pth, model-ema.pth) and test_deepspeed_world_size.py (the
EMA on another world size)."""

from __future__ import annotations

import pytest
import torch

from tests.runs import assert_all_ok, run_dir, run_ranks

WIDTH, DEPTH = 512, 24
ARGS = ("--stack", "deepspeed", "--deepspeed.zero_stage", "3", "--ema.enabled", "true", "--steps", "1")
ARGS += ("--dataset_size", "8", "--dataloader.batch_size", "4", "--dist.timeout", "60", "--ckpt.interval", "1")
ARGS += ("--width", str(WIDTH), "--depth", str(DEPTH))
MODEL_BYTES = 4 * (16 * WIDTH + WIDTH + (DEPTH + 1) * (WIDTH * WIDTH + WIDTH) + 2 * WIDTH + 2)


@pytest.mark.timeout(300)
def test_no_rank_holds_the_model_or_the_ema_while_it_saves_or_exports(tmp_path):
    assert_all_ok(run_ranks(2, "zero_init_mlp.py", tmp_path / "runs", *ARGS, CHECKPOINT_RSS=tmp_path / "ckpt-{rank}",
                            EXPORT_RSS=tmp_path / "export-{rank}", MALLOC_MMAP_THRESHOLD_="131072"))  # fmt: skip
    checkpoint = [int((tmp_path / f"ckpt-{rank}").read_text()) for rank in range(2)]
    export = [int((tmp_path / f"export-{rank}").read_text()) for rank in range(2)]
    assert max(export) < MODEL_BYTES / 4, f"export rises {export}; model {MODEL_BYTES}"
    assert max(checkpoint) < MODEL_BYTES / 4, f"checkpoint rises {checkpoint}; model {MODEL_BYTES}"
    directory = run_dir(tmp_path / "runs")
    for name in ("model.pth", "model-ema.pth"):
        weights = torch.load(directory / name, weights_only=True)
        assert sum(tensor.nbytes for tensor in weights.values()) == MODEL_BYTES
