"""The commit protocol: staging, manifest last, immutable checkpoints, atomic pointers, quarantine."""

from __future__ import annotations

import json
import os

import pytest
import torch

from perdure.checkpoints import commit
from perdure.checkpoints.commit import (
    CHECKPOINT_PATTERN,
    HASH_ALGORITHM,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    FileRecord,
    HashingWriter,
    checkpoint_name,
    commit_checkpoint,
    hash_file,
    make_staging_dir,
    quarantine,
    read_manifest,
    read_pointer,
    verify_checkpoint,
    write_file,
    write_pointer,
)
from perdure.errors import CheckpointCorruptError, CheckpointError


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.zeros(32)}, "step": seed}


def _write_checkpoint(root, step: int, meta: dict | None = None):
    staging = make_staging_dir(root, checkpoint_name(step=step))
    files = {
        "state.pth": write_file(staging / "state.pth", lambda f: torch.save(_state(step), f)),
    }
    (staging / "ranks").mkdir()
    files["ranks/rank00001.pth"] = write_file(staging / "ranks/rank00001.pth", lambda f: torch.save({"r": 1}, f))
    final = root / checkpoint_name(step=step)
    manifest = commit_checkpoint(staging, final, files, {"global_step": step, "epoch": 0, **(meta or {})})
    return final, files, manifest


def test_checkpoint_name_and_pattern():
    assert checkpoint_name(step=42) == "ckpt-s000000000042"
    assert checkpoint_name(epoch=3) == "ckpt-e000003"
    assert CHECKPOINT_PATTERN.match("ckpt-s000000000042")["step"] == "000000000042"
    assert CHECKPOINT_PATTERN.match("ckpt-e000003")["epoch"] == "000003"
    for bad in ("ckpt-s42", "ckpt-e3", ".tmp-ckpt-s000000000042", "ckpt-s000000000042-x", "latest"):
        assert not CHECKPOINT_PATTERN.match(bad)
    for kwargs in ({}, {"step": 1, "epoch": 1}, {"step": -1}, {"step": True}, {"epoch": 1.0}):
        with pytest.raises(ValueError):
            checkpoint_name(**kwargs)


def test_hashing_writer_with_torch_save_matches_hash_file(tmp_path):
    path = tmp_path / "state.pth"
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        torch.save(_state(), writer)
    record = writer.record()
    assert record == hash_file(path)
    assert record.size == path.stat().st_size
    loaded = torch.load(path)
    assert torch.equal(loaded["model"]["w"], _state()["model"]["w"])


def test_write_file_records_while_writing_and_never_overwrites(tmp_path):
    path = tmp_path / "x.bin"
    record = write_file(path, lambda f: (f.write(b"hello "), f.write(memoryview(b"world"))))
    assert record == hash_file(path) == FileRecord(11, record.digest)
    assert len(record.digest) == 32
    with pytest.raises(FileExistsError):
        write_file(path, lambda f: f.write(b"other"))
    assert path.read_bytes() == b"hello world"

    def boom(f):
        f.write(b"partial")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        write_file(tmp_path / "y.bin", boom)
    assert not (tmp_path / "y.bin").exists()


def test_hash_file_small_chunks(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(os.urandom(100_003))
    assert hash_file(path, chunk=4096) == hash_file(path)


def test_commit_writes_manifest_last_with_sizes_and_digests(tmp_path, monkeypatch):
    order = []
    real_write_file = commit.write_file
    monkeypatch.setattr(commit, "write_file", lambda p, w: (order.append(p.name), real_write_file(p, w))[1])
    renamed = []
    real_rename = os.rename
    monkeypatch.setattr(commit.os, "rename", lambda a, b: (renamed.append((a, b)), real_rename(a, b))[1])

    final, files, manifest = _write_checkpoint(tmp_path, 100, {"config_id": "abc", "world_size": 2})
    assert order == [MANIFEST_NAME] and len(renamed) == 1  # backend files came earlier, via the unpatched name
    assert final.is_dir() and not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    on_disk = json.loads((final / MANIFEST_NAME).read_text())
    assert on_disk == manifest == read_manifest(final)
    assert manifest["format"] == MANIFEST_FORMAT and manifest["hash"] == HASH_ALGORITHM
    assert manifest["name"] == final.name and manifest["global_step"] == 100 and manifest["config_id"] == "abc"
    assert manifest["created"].endswith("+00:00")
    assert set(manifest["files"]) == {"state.pth", "ranks/rank00001.pth"}
    for rel, entry in manifest["files"].items():
        assert FileRecord(entry["size"], entry["digest"]) == hash_file(final / rel) == files[rel]
    # manifest.json is the newest file in the dir: written after every payload file
    newest = max((final / rel).stat().st_mtime_ns for rel in files)
    assert (final / MANIFEST_NAME).stat().st_mtime_ns >= newest
    assert verify_checkpoint(final) == manifest


def test_commit_refuses_existing_final(tmp_path):
    final, _, _ = _write_checkpoint(tmp_path, 5)
    before = (final / MANIFEST_NAME).read_bytes()
    with pytest.raises(CheckpointError, match="already exists"):
        _write_checkpoint(tmp_path, 5)
    assert (final / MANIFEST_NAME).read_bytes() == before


def test_commit_refuses_missing_resized_or_unlisted_files(tmp_path):
    staging = make_staging_dir(tmp_path, "ckpt-s000000000001")
    final = tmp_path / "ckpt-s000000000001"
    rec = write_file(staging / "a.pth", lambda f: f.write(b"abc"))
    with pytest.raises(CheckpointError, match="b.pth is listed but missing"):
        commit_checkpoint(staging, final, {"a.pth": rec, "b.pth": rec}, {})
    with pytest.raises(CheckpointError, match="size 3 != 4"):
        commit_checkpoint(staging, final, {"a.pth": FileRecord(4, rec.digest)}, {})
    (staging / "stray.tmp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="stray.tmp"):
        commit_checkpoint(staging, final, {"a.pth": rec}, {})
    (staging / "stray.tmp").unlink()
    with pytest.raises(CheckpointError, match="may not set"):
        commit_checkpoint(staging, final, {"a.pth": rec}, {"files": {}})
    with pytest.raises(CheckpointError, match="not a checkpoint name"):
        commit_checkpoint(staging, tmp_path / "final", {"a.pth": rec}, {})
    with pytest.raises(CheckpointError, match="relative posix path"):
        commit_checkpoint(staging, final, {"../a.pth": rec}, {})
    assert not final.exists() and not (staging / MANIFEST_NAME).exists()
    commit_checkpoint(staging, final, {"a.pth": rec}, {})
    assert verify_checkpoint(final)["files"] == {"a.pth": {"size": 3, "digest": rec.digest}}


def test_make_staging_dir_creates_root_and_unique_dirs(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    a, b = make_staging_dir(root, "ckpt-s000000000001"), make_staging_dir(root, "ckpt-s000000000001")
    assert a != b and a.is_dir() and b.is_dir() and a.parent == root
    assert a.name.startswith(f".tmp-ckpt-s000000000001-{os.getpid()}-")


def test_pointers_are_atomic_and_leave_no_temp_files(tmp_path):
    assert read_pointer(tmp_path, "latest") is None
    write_pointer(tmp_path, "latest", "ckpt-s000000000001")
    write_pointer(tmp_path, "latest", "ckpt-s000000000002")
    write_pointer(tmp_path, "best", "ckpt-e000001")
    assert (tmp_path / "latest").read_text() == "ckpt-s000000000002\n"
    assert read_pointer(tmp_path, "latest") == "ckpt-s000000000002"
    assert read_pointer(tmp_path, "best") == "ckpt-e000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "latest"]
    with pytest.raises(ValueError):
        write_pointer(tmp_path, "newest", "ckpt-s000000000001")
    with pytest.raises(ValueError):
        write_pointer(tmp_path, "latest", "../elsewhere")
    (tmp_path / "latest").write_bytes(b"\xff\xfegarbage \n")
    assert "garbage" in read_pointer(tmp_path, "latest")  # returned, not raised


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "manifest.json missing"),
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (json.dumps({"format": "other/9"}).encode(), "format 'other/9'"),
        (json.dumps({"format": MANIFEST_FORMAT, "name": "x"}).encode(), "lacks field"),
    ],
)
def test_read_manifest_rejects_bad_manifests(tmp_path, content, reason):
    if content is not None:
        (tmp_path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match=reason) as info:
        read_manifest(tmp_path)
    assert info.value.path == tmp_path and reason in info.value.reason


def test_verify_names_the_bad_file(tmp_path):
    final, _, manifest = _write_checkpoint(tmp_path, 7)
    rank_file = final / "ranks/rank00001.pth"
    data = bytearray(rank_file.read_bytes())
    data[len(data) // 2] ^= 0x01
    rank_file.write_bytes(bytes(data))
    verify_checkpoint(final, deep=False)  # same size: only the checksum can tell
    with pytest.raises(CheckpointCorruptError, match=r"ranks/rank00001.pth: checksum mismatch"):
        verify_checkpoint(final)
    size = manifest["files"]["state.pth"]["size"]
    with open(final / "state.pth", "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointCorruptError, match=rf"state.pth: size {size - 10} != {size} in manifest"):
        verify_checkpoint(final, deep=False)
    (final / "state.pth").unlink()
    with pytest.raises(CheckpointCorruptError, match="state.pth missing"):
        verify_checkpoint(final)


def test_verify_checks_the_directory_name(tmp_path):
    final, _, _ = _write_checkpoint(tmp_path, 7)
    renamed = final.rename(tmp_path / "ckpt-s000000000009")
    with pytest.raises(CheckpointCorruptError, match="names 'ckpt-s000000000007'"):
        verify_checkpoint(renamed)
    assert verify_checkpoint(renamed, check_name=False)["global_step"] == 7
    with pytest.raises(CheckpointCorruptError, match="does not exist"):
        verify_checkpoint(tmp_path / "nope")


def test_quarantine_moves_and_explains_never_deletes(tmp_path):
    final, files, _ = _write_checkpoint(tmp_path, 3)
    contents = {rel: (final / rel).read_bytes() for rel in files}
    moved = quarantine(final, "state.pth: checksum mismatch")
    assert not final.exists() and moved.parent == tmp_path / "quarantine"
    assert moved.name.startswith("ckpt-s000000000003-")
    assert {rel: (moved / rel).read_bytes() for rel in files} == contents
    reason = (moved / "REASON.txt").read_text()
    assert "state.pth: checksum mismatch" in reason and str(final) in reason

    # same name again within the same second: a unique destination, the first one untouched
    again, _, _ = _write_checkpoint(tmp_path, 3)
    moved2 = quarantine(again, "second")
    assert moved2 != moved and (moved / "REASON.txt").read_text() == reason

    staging = make_staging_dir(tmp_path, "ckpt-s000000000004")
    moved3 = quarantine(staging, "interrupted save")
    assert moved3.name.startswith("tmp-ckpt-s000000000004-") and (moved3 / "REASON.txt").exists()
