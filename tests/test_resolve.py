"""Resolution: every corruption falls back to the newest good checkpoint and quarantines the bad one."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch

from perdure.checkpoints.commit import (
    MANIFEST_NAME,
    checkpoint_name,
    commit_checkpoint,
    make_staging_dir,
    read_pointer,
    write_file,
    write_pointer,
)
from perdure.checkpoints.resolve import (
    best_checkpoint,
    committed_checkpoints,
    resolve_latest,
    resolve_path,
)
from perdure.errors import CheckpointCorruptError, CheckpointError


def save(root: Path, step: int | None = None, *, epoch: int | None = None, pointer: bool = True) -> Path:
    """A real file-backend-like checkpoint: state.pth plus one per-rank file, committed, then `latest` moved."""
    name = checkpoint_name(step=step) if step is not None else checkpoint_name(epoch=epoch)
    staging = make_staging_dir(root, name)
    g = torch.Generator().manual_seed(step or epoch or 0)
    files = {
        "state.pth": write_file(staging / "state.pth", lambda f: torch.save({"w": torch.randn(256, generator=g)}, f)),
        "rank00001.pth": write_file(staging / "rank00001.pth", lambda f: torch.save({"rng": torch.arange(8)}, f)),
    }
    meta = {"global_step": step if step is not None else 10 * epoch, "epoch": epoch or 0}
    commit_checkpoint(staging, root / name, files, meta)
    if pointer:
        write_pointer(root, "latest", name)
    return root / name


@pytest.fixture
def run(tmp_path):
    """A run with checkpoints at steps 10, 20, 30; `latest` names step 30."""
    root = tmp_path / "run" / "checkpoints"
    for step in (10, 20, 30):
        save(root, step)
    return root


@pytest.fixture
def warnings_seen():
    return []


def resolve(root, warnings_seen, **kwargs):
    return resolve_latest(root, warn=warnings_seen.append, **kwargs)


def quarantined(root: Path) -> list[str]:
    q = root / "quarantine"
    return sorted(p.name for p in q.iterdir()) if q.is_dir() else []


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every path under root with its mtime and content hash: proves nothing was written."""
    out = {}
    for p in sorted(root.rglob("*")):
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        out[str(p.relative_to(root))] = (p.stat().st_mtime_ns, digest)
    return out


def test_clean_run_resolves_to_latest_without_warnings(run, warnings_seen):
    info = resolve(run, warnings_seen)
    assert info.name == "ckpt-s000000000030" and info.global_step == 30 and info.epoch == 0
    assert info.path == run / info.name and info.manifest["name"] == info.name
    assert warnings_seen == [] and quarantined(run) == []


def test_no_checkpoints_is_none_and_silent(tmp_path, warnings_seen):
    assert resolve(tmp_path / "missing", warnings_seen) is None
    assert not (tmp_path / "missing").exists()
    (tmp_path / "empty").mkdir()
    assert resolve(tmp_path / "empty", warnings_seen) is None
    assert warnings_seen == []


@pytest.mark.parametrize(
    ("content", "expect"),
    [(None, "is missing"), ("not a checkpoint!", "'not a checkpoint!'"), ("ckpt-s000000000099", "does not exist")],
)
def test_bad_latest_pointer_uses_newest_good_and_rewrites_pointer(run, warnings_seen, content, expect):
    if content is None:
        (run / "latest").unlink()
    else:
        (run / "latest").write_text(content)
    info = resolve(run, warnings_seen)
    assert info.name == "ckpt-s000000000030"
    assert read_pointer(run, "latest") == "ckpt-s000000000030"
    assert any(expect in w and w.startswith("CHECKPOINT PROBLEM") for w in warnings_seen)
    assert quarantined(run) == []


def _drop_manifest(d: Path):
    (d / MANIFEST_NAME).unlink()


def _garble_manifest(d: Path):
    (d / MANIFEST_NAME).write_text('{"format": "perdure-checkpoint/1", "files": ')


def _edit_manifest(field: str, value):
    def edit(d: Path):
        manifest = json.loads((d / MANIFEST_NAME).read_text())
        manifest["files"]["state.pth"][field] = value
        (d / MANIFEST_NAME).write_text(json.dumps(manifest))

    return edit


def _truncate(d: Path):
    data = (d / "state.pth").read_bytes()
    (d / "state.pth").write_bytes(data[: len(data) // 2])


def _flip_byte(d: Path):
    data = bytearray((d / "rank00001.pth").read_bytes())
    data[-40] ^= 0xFF
    (d / "rank00001.pth").write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_drop_manifest, "manifest.json missing"),
        (_garble_manifest, "not valid JSON"),
        (_edit_manifest("size", 123), "state.pth: size"),
        (_edit_manifest("digest", "0" * 32), "state.pth: checksum mismatch"),
        (_truncate, "state.pth: size"),
        (_flip_byte, "rank00001.pth: checksum mismatch"),
    ],
)
def test_corrupt_latest_falls_back_and_is_quarantined(run, warnings_seen, corrupt, reason):
    write_pointer(run, "best", "ckpt-s000000000030")
    corrupt(run / "ckpt-s000000000030")
    info = resolve(run, warnings_seen)
    assert info.name == "ckpt-s000000000020"
    assert not (run / "ckpt-s000000000030").exists()
    [moved] = quarantined(run)
    assert moved.startswith("ckpt-s000000000030-")
    assert reason in (run / "quarantine" / moved / "REASON.txt").read_text()
    problem = [w for w in warnings_seen if "failed verification" in w]
    assert len(problem) == 1 and reason in problem[0] and "ckpt-s000000000020" in problem[0]
    assert problem[0].startswith("CHECKPOINT PROBLEM")
    assert read_pointer(run, "latest") == "ckpt-s000000000020"
    assert not (run / "best").exists()  # it named the quarantined dir
    # a second resolve is clean: nothing left to repair, no loop
    warnings_seen.clear()
    assert resolve(run, warnings_seen).name == "ckpt-s000000000020" and warnings_seen == []


def test_several_bad_checkpoints_fall_back_past_all_of_them(run, warnings_seen):
    _flip_byte(run / "ckpt-s000000000030")
    _drop_manifest(run / "ckpt-s000000000020")
    write_pointer(run, "best", "ckpt-s000000000010")
    info = resolve(run, warnings_seen)
    assert info.name == "ckpt-s000000000010" and len(quarantined(run)) == 2
    assert read_pointer(run, "best") == "ckpt-s000000000010"  # still valid: kept


def test_interrupted_save_staging_dir_is_quarantined(run, warnings_seen):
    staging = make_staging_dir(run, checkpoint_name(step=40))
    (staging / "state.pth").write_bytes(b"half a checkpoint")
    info = resolve(run, warnings_seen)
    assert info.name == "ckpt-s000000000030" and not staging.exists()
    [moved] = quarantined(run)
    assert moved.startswith("tmp-ckpt-s000000000040-")
    assert "interrupted save" in (run / "quarantine" / moved / "REASON.txt").read_text()
    assert (run / "quarantine" / moved / "state.pth").read_bytes() == b"half a checkpoint"
    assert any("interrupted save" in w for w in warnings_seen)


def test_committed_dir_newer_than_pointer_is_used(run, warnings_seen):
    save(run, 40, pointer=False)  # killed between the rename and the pointer update
    assert read_pointer(run, "latest") == "ckpt-s000000000030"
    info = resolve(run, warnings_seen)
    assert info.name == "ckpt-s000000000040" and read_pointer(run, "latest") == "ckpt-s000000000040"
    assert quarantined(run) == []


def test_all_bad_returns_none_and_quarantines_everything(run, warnings_seen):
    for step in (10, 20, 30):
        _truncate(run / checkpoint_name(step=step))
    write_pointer(run, "best", "ckpt-s000000000020")
    assert resolve(run, warnings_seen) is None
    assert len(quarantined(run)) == 3 and committed_checkpoints(run) == []
    assert not (run / "latest").exists() and not (run / "best").exists()
    assert all("no older checkpoint verifies" in w for w in warnings_seen if "failed verification" in w)
    assert resolve(run, []) is None


def test_repair_false_writes_nothing(run, warnings_seen):
    _flip_byte(run / "ckpt-s000000000030")
    make_staging_dir(run, "ckpt-s000000000040")
    save(run, 25, pointer=False)
    (run / "latest").write_text("garbage")
    write_pointer(run, "best", "ckpt-s000000000099")
    before = snapshot(run)
    info = resolve(run, warnings_seen, repair=False)
    assert info.name == "ckpt-s000000000025"
    assert snapshot(run) == before
    assert any("ckpt-s000000000030" in w and "left in place" in w for w in warnings_seen)


def test_epoch_checkpoints_order_by_manifest_step(tmp_path, warnings_seen):
    root = tmp_path / "checkpoints"
    for epoch in (1, 2, 3):
        save(root, epoch=epoch)
    assert [p.name for p in committed_checkpoints(root)] == ["ckpt-e000003", "ckpt-e000002", "ckpt-e000001"]
    # an unreadable manifest hides the step; the dir still sorts by its epoch number, so it is tried first
    _drop_manifest(root / "ckpt-e000003")
    _garble_manifest(root / "ckpt-e000002")
    assert [p.name for p in committed_checkpoints(root)] == ["ckpt-e000003", "ckpt-e000002", "ckpt-e000001"]
    info = resolve(root, warnings_seen)
    assert info.name == "ckpt-e000001" and info.epoch == 1 and info.global_step == 10
    assert len(quarantined(root)) == 2 and read_pointer(root, "latest") == "ckpt-e000001"


def test_default_warnings_go_to_the_perdure_logger(run, caplog):
    (run / "latest").unlink()
    with caplog.at_level(logging.WARNING, logger="perdure"):
        resolve_latest(run)
    assert any(r.name == "perdure" and "CHECKPOINT PROBLEM" in r.getMessage() for r in caplog.records)


def test_resolve_path_accepts_checkpoint_checkpoints_and_run_dirs(run, warnings_seen):
    assert resolve_path(run / "ckpt-s000000000020").name == "ckpt-s000000000020"
    assert resolve_path(run).name == "ckpt-s000000000030"
    assert resolve_path(run.parent).name == "ckpt-s000000000030"
    copy = run.parent / "exported"  # a checkpoint copied under another name still verifies
    (run / "ckpt-s000000000010").rename(copy)
    info = resolve_path(copy)
    assert info.path == copy and info.name == "ckpt-s000000000010"


def test_resolve_path_on_other_runs_never_repairs(run, warnings_seen):
    _flip_byte(run / "ckpt-s000000000030")
    before = snapshot(run)
    assert resolve_path(run.parent, warn=warnings_seen.append).name == "ckpt-s000000000020"
    assert snapshot(run) == before and warnings_seen


def test_resolve_path_errors(run, tmp_path):
    bad = run / "ckpt-s000000000030"
    _flip_byte(bad)
    with pytest.raises(CheckpointCorruptError, match="rank00001.pth: checksum mismatch"):
        resolve_path(bad)
    assert bad.exists()  # named explicitly: reported, not moved
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_path(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CheckpointError, match="is not a checkpoint: looked for manifest.json"):
        resolve_path(tmp_path / "plain")
    (tmp_path / "model.pth").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="is a file"):
        resolve_path(tmp_path / "model.pth")
    for step in (10, 20):
        _truncate(run / checkpoint_name(step=step))
    with pytest.raises(CheckpointError, match="none verifies"):
        resolve_path(run, warn=lambda m: None)


def test_best_checkpoint(run, warnings_seen):
    assert best_checkpoint(run) is None
    write_pointer(run, "best", "ckpt-s000000000020")
    assert best_checkpoint(run).name == "ckpt-s000000000020"
    _truncate(run / "ckpt-s000000000020")
    assert best_checkpoint(run, warn=warnings_seen.append) is None
    assert "failed verification" in warnings_seen[0]
    (run / "best").write_text("junk")
    assert best_checkpoint(run, warn=warnings_seen.append) is None
