"""Issue 32: an export's metadata is published with the file; it names the run and the checkpoint, never a path of
the training machine (it used to hold the absolute run directory as `source`)."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.security.hostile import perdure_cli, run_dir_of, train_victim

pytestmark = pytest.mark.timeout(120)


def test_exports_name_the_run_and_checkpoint_not_a_path(tmp_path):
    run = train_victim(tmp_path / "runs", **{"ckpt.export_format": "safetensors"})
    assert run == run_dir_of(tmp_path / "runs")
    result = perdure_cli("ckpt", "export", run / "checkpoints" / "ckpt-s000000000002", tmp_path / "out.safetensors")
    assert result.returncode == 0, result.stderr
    for path, checkpoint in ((run / "model.safetensors", "ckpt-s000000000004"), (tmp_path / "out.safetensors",
                                                                                   "ckpt-s000000000002")):  # fmt: skip
        with safe_open(str(path), "pt") as file:
            metadata = file.metadata()
        assert metadata == {"format": "pt", "run": "victim", "checkpoint": checkpoint}
        assert str(tmp_path) not in json.dumps(metadata)
