"""Issue 32, item 2: a DCP `.metadata` that loads normally cannot change a class (or anything else it did not create)
for the rest of the process.

The pickle sets `Metadata.__getstate__` and `pathlib.Path.is_symlink` with pickle's BUILD opcode, then holds the real
metadata, so that training would go on while every later DCP checkpoint of the process is written empty (passing
`perdure ckpt verify`, loadable never) and every later symlink check answers "no".
"""

from __future__ import annotations

import pathlib

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from perdure import CheckpointError
from perdure.checkpoints.safe_dcp import read_dcp_metadata
from tests.security.hostile import latest, poison_dcp_metadata_classes, resume, run_dir_of, text

pytestmark = pytest.mark.timeout(120)

IS_SYMLINK = pathlib.Path.is_symlink


def test_a_metadata_that_sets_class_attributes_is_refused_and_changes_nothing(dcp_root):
    checkpoint = latest(run_dir_of(dcp_root))
    poison_dcp_metadata_classes(checkpoint)
    try:
        with pytest.raises(CheckpointError) as error:
            read_dcp_metadata(checkpoint)
        assert "__getstate__" not in vars(Metadata), "Metadata's class attributes changed"
        assert pathlib.Path.is_symlink is IS_SYMLINK, "pathlib.Path.is_symlink changed"
    finally:  # on code without the check, undo the damage so that the rest of this test process is not poisoned
        if "__getstate__" in vars(Metadata):
            del Metadata.__getstate__
        pathlib.Path.is_symlink = IS_SYMLINK
    message = str(error.value)
    assert f"refused to load {checkpoint}/.metadata" in message
    assert "sets attributes of the class torch.distributed.checkpoint.metadata.Metadata" in message


def test_resuming_from_it_is_refused(dcp_root):
    checkpoint = latest(run_dir_of(dcp_root))
    poison_dcp_metadata_classes(checkpoint)
    result = resume(dcp_root, "--ckpt.backend", "dcp")
    output = text(result)
    assert result.returncode != 0, output  # training never went on to write checkpoints that cannot be loaded
    assert f"refused to load {checkpoint}/.metadata" in output and "Traceback" not in output, output
    assert not (run_dir_of(dcp_root) / "checkpoints" / "ckpt-s000000000006").exists()
