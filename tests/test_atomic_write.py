"""perdure.atomic: the one atomic write leaves the old file or the new one, and no temporary file on any failure."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

import perdure.atomic
from perdure.atomic import atomic_write, atomic_write_by_name, atomic_write_text
from perdure.loggers.files import StepLines


class Unserialisable:
    def __reduce__(self) -> str:
        raise RuntimeError("cannot be serialised")


def write_half_then_fail(file) -> None:
    file.write(b"half of the new content")
    raise RuntimeError("the writer failed mid-way")


def test_the_new_content_replaces_the_old(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    atomic_write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_writer_that_raises_mid_way_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    import pickle

    path = tmp_path / "state.pkl"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="mid-way"):
        atomic_write(path, write_half_then_fail)
    with pytest.raises(RuntimeError, match="cannot be serialised"):
        atomic_write(path, lambda file: pickle.dump({"a": 1, "b": Unserialisable()}, file))
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pkl"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root renames into a read-only directory")
def test_a_rename_the_directory_refuses_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OSError):
            atomic_write_text(path, "new")
    finally:
        tmp_path.chmod(0o700)
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failing_rename_removes_the_temporary(tmp_path: Path, monkeypatch) -> None:
    # Also as root: the rename itself fails (EXDEV, EACCES, ...) after the temporary file was written.
    path = tmp_path / "state.json"
    path.write_text("old")

    def refuse(source, target) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(perdure.atomic.os, "replace", refuse)
    with pytest.raises(PermissionError):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_failed_rewrite_of_a_metrics_file_leaves_no_temporary(tmp_path: Path, monkeypatch) -> None:
    # loggers/files.py used to leave its temporary file behind when the rename failed.
    path = tmp_path / "metrics.csv"
    path.write_text("step,loss\n1,0.5\n2,0.4\n")
    metrics = StepLines(path, step_of=lambda line: int(line.split(",")[0]), header="step,loss")

    def refuse(source, target) -> None:
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(perdure.atomic.os, "replace", refuse)
    with pytest.raises(PermissionError):
        metrics.open(resumed_step=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv"]


def test_a_library_writing_by_name_that_fails_mid_way_leaves_no_temporary(tmp_path: Path) -> None:
    # safetensors' save_file and pyarrow write to a file name (runners/export.py, workspace/registry.py)
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")
    seen: list[Path] = []

    def write_half_then_fail(temporary: Path) -> None:
        seen.append(temporary)
        temporary.write_bytes(b"half of the new content")
        raise RuntimeError("the library failed mid-way")

    with pytest.raises(RuntimeError, match="mid-way"):
        atomic_write_by_name(path, write_half_then_fail)
    assert seen and seen[0].parent == tmp_path and seen[0].name.startswith(".model.safetensors.tmp-")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    atomic_write_by_name(path, lambda temporary: temporary.write_bytes(b"new"))
    assert path.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_non_durable_write_that_fails_leaves_no_temporary(tmp_path: Path) -> None:
    # sidecar.json between checkpoints and media PNGs: replaced atomically, not fsynced
    path = tmp_path / "sidecar.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="mid-way"):
        atomic_write(path, write_half_then_fail, durable=False)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["sidecar.json"]


def test_the_weights_export_leaves_no_temporary_when_the_write_fails(tmp_path: Path, monkeypatch) -> None:
    import torch

    from perdure.runners.export import export_weights

    path = tmp_path / "model.pth"
    export_weights({"w": torch.ones(2)}, path)

    def full_disk(obj, file) -> None:
        file.write(b"part of the weights")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left") as failure:
        export_weights({"w": torch.zeros(2)}, path)
    assert failure.value.filename == str(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pth"]
    assert torch.load(path, weights_only=True)["w"].tolist() == [1.0, 1.0]


def test_the_atomic_module_is_a_leaf() -> None:
    tree = ast.parse(Path(perdure.atomic.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not [name for name in imported if name.split(".")[0] == "perdure"]
