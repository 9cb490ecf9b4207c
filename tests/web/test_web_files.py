"""The viewer's careful readers (perdure/web/files.py, series.py) and its checkpoint checks, without a server."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from perdure.checkpoints.commit import quarantine
from perdure.web.files import Refused, inside, join_inside, read_bytes, read_tail, read_yaml
from perdure.web.series import read_media, read_metrics
from perdure.web.workspace_view import WorkspaceView


def test_reads_are_bounded_and_regular_files_only(tmp_path):
    big = tmp_path / "big.log"
    big.write_bytes(b"x" * (4 << 20) + b"\nlast line\n")
    with pytest.raises(Refused, match="more than"):
        read_bytes(big, 1 << 20)
    text, truncated, size = read_tail(big, 64)
    assert (text, truncated, size) == ("last line\n", True, (4 << 20) + 11)

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(Refused, match="not a regular file"):
        read_bytes(fifo, 1024)  # a FIFO with no writer: opening it must not block
    assert time.monotonic() - started < 5
    with pytest.raises(Refused, match="not a regular file"):
        read_bytes(tmp_path, 1024)


def test_paths_stay_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (tmp_path / "secret").write_text("secret")
    (root / "run" / "out").symlink_to(tmp_path / "secret")
    (root / "run" / "ok").write_text("ok")
    assert inside(root, root / "run" / "ok") == (root / "run" / "ok").resolve()
    with pytest.raises(Refused, match="outside the workspace root"):
        inside(root, root / "run" / "out")
    for relative in ("../secret", "/etc/passwd", "a/../../secret", "a\\..\\b", "", "~/x"):
        with pytest.raises(Refused):
            join_inside(root, root / "run", relative)
    with pytest.raises(Refused):
        join_inside(root, root / "run", "out")


def test_yaml_is_safe_and_bounded(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb.write_text("\n".join(lines) + "\n")
    with pytest.raises(Refused, match="expands past"):
        read_yaml(bomb, 1 << 20)
    code = tmp_path / "code.yaml"
    code.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(Refused, match="not valid YAML"):
        read_yaml(code, 1 << 20)
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(Refused):
        read_yaml(deep, 1 << 20)


def test_metrics_and_media_files_from_elsewhere_are_parsed_defensively(tmp_path):
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("step,split,name,value\n2,train,loss,0.5\ngarbage\n4,train,loss,nan\nx,train,loss,1\n6,train,lo")
    assert read_metrics(metrics) == {"train/loss": {"step": [2, 4], "value": [0.5, None]}}
    media = tmp_path / "media.jsonl"
    good = {"step": 5, "tag": "a/b", "index": 0, "path": "media/a_b/00000005_0.png"}
    lines = [
        json.dumps(good),
        "[" * 100_000 + "]" * 100_000,  # too deep for the JSON parser: skipped, not a crash
        json.dumps({**good, "path": "../media/x.png"}),
        json.dumps({**good, "path": "/etc/passwd"}),
        json.dumps({**good, "path": "media/a_b/x.txt"}),
        json.dumps({**good, "step": "5"}),
        json.dumps({**good, "step": True}),
        "not json",
    ]
    media.write_text("\n".join(lines) + "\n")
    assert read_media(media) == [good]


def test_checkpoint_verification_tampering_quarantine_and_symlinks(web_workspace, tmp_path):
    root = tmp_path / "root"
    group, name = web_workspace.ids["baseline"].split("/")
    shutil.copytree(web_workspace.root / group / name, root / group / name, symlinks=True)
    view = WorkspaceView(root)
    run_id = f"{group}/{name}"
    checkpoints = root / group / name / "checkpoints"

    listed = view.run(run_id)["checkpoints"]
    assert [c["verified"] for c in listed["checkpoints"]] == [True, True, True]

    state = checkpoints / "ckpt-s000000000030" / "state.pth"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))  # same size: only the checksum can tell
    deadline = time.monotonic() + 60  # the table answers from sizes at once, from checksums once hashed
    while (latest := view.runs()[0])["checkpoint_checked"] != "checksums":
        assert latest["checkpoint_verified"] is True and time.monotonic() < deadline
        time.sleep(0.05)
    assert (latest["checkpoint_verified"], latest["checkpoint_problem"]) == (False, "state.pth: checksum mismatch")
    newest = view.run(run_id)["checkpoints"]["checkpoints"][0]
    assert (newest["verified"], newest["checked"]) == (False, "checksums")
    assert newest["problem"] == "state.pth: checksum mismatch"

    (checkpoints / "ckpt-s000000000020" / "extra").symlink_to(web_workspace.secret)
    quarantine(checkpoints / "ckpt-s000000000030", "state.pth: checksum mismatch")
    detail = view.run(run_id)["checkpoints"]
    assert [c["name"] for c in detail["checkpoints"]] == ["ckpt-s000000000020", "ckpt-s000000000010"]
    assert detail["checkpoints"][0]["verified"] is False
    assert detail["checkpoints"][0]["problem"] == "extra is a symlink (a checkpoint holds regular files only)"
    (entry,) = detail["quarantined"]
    assert entry["name"].startswith("ckpt-s000000000030-") and entry["reason"] == "state.pth: checksum mismatch"
    view.close()
