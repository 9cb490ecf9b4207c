"""sidecar.json: attempts, summary, strict JSON, corrupt files, heartbeat and the stale status."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import pytest
import torch

from perdure.errors import PerdureError
from perdure.workspace.heartbeat import HEARTBEAT_NAME, heartbeat_mtime, touch_heartbeat
from perdure.workspace.sidecar import (
    SIDECAR_FORMAT,
    SIDECAR_NAME,
    Sidecar,
    SidecarError,
    effective_status,
    parse_stamp,
    read_sidecar,
    utc_stamp,
)

HPARAMS = {"optim": {"lr": 0.001, "betas": (0.9, 0.999)}, "model_width": 64}


def make(run_dir: Path, **overrides) -> Sidecar:
    identity = dict(
        run_id="abc1234-0123456789ab",
        lineage="mlp",
        code_id="abc1234",
        config_id="0123456789ab",
        hparams=HPARAMS,
        tags=["baseline"],
    )
    identity.update(overrides)
    return Sidecar(run_dir, **identity)


def start(sidecar: Sidecar, resumed_step: int = 0, resumed_from: str | None = None) -> dict:
    return sidecar.start_attempt(
        started=utc_stamp(),
        restart_counts={"SLURM_RESTART_COUNT": None, "TORCHELASTIC_RESTART_COUNT": 0},
        resumed_from=resumed_from,
        resumed_step=resumed_step,
    )


def strict_load(path: Path) -> dict:
    def refuse(token: str) -> None:
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(path.read_text(), parse_constant=refuse)


@pytest.fixture
def perdure_log() -> list[logging.LogRecord]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("perdure")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_write_layout_and_heartbeat(tmp_path: Path):
    sidecar = make(tmp_path / "run")
    start(sidecar)
    sidecar.write()
    data = strict_load(tmp_path / "run" / SIDECAR_NAME)
    assert data["format"] == SIDECAR_FORMAT
    for key in ("run_id", "lineage", "code_id", "config_id", "path", "status", "tags", "hparams", "summary"):
        assert key in data
    for key in ("latest_checkpoint", "best_checkpoint", "attempts", "created", "updated"):
        assert key in data
    assert data["status"] == "running" and data["path"] == str((tmp_path / "run").absolute())
    assert data["hparams"] == {"optim": {"lr": 0.001, "betas": [0.9, 0.999]}, "model_width": 64}
    assert data["tags"] == ["baseline"]
    assert (tmp_path / "run" / HEARTBEAT_NAME).exists()
    assert read_sidecar(tmp_path / "run" / SIDECAR_NAME) == data == sidecar.to_dict()
    assert parse_stamp(data["created"]) <= parse_stamp(data["updated"]) <= time.time()


def test_attempt_fields(tmp_path: Path):
    sidecar = make(tmp_path)
    attempt = start(sidecar)
    assert attempt == {
        "started": attempt["started"],
        "ended": None,
        "exit_reason": None,
        "status": "running",
        "resumed_from": None,
        "resumed_step": 0,
        "restart_counts": {"SLURM_RESTART_COUNT": None, "TORCHELASTIC_RESTART_COUNT": 0},
        "steps_done": 0,
        "last_step": 0,
        "steps_lost": 0,
        "save_seconds": 0.0,
        "save_failures": [],
    }
    sidecar.record(step=10, epoch=0, save_seconds=0.25, latest_checkpoint="ckpt-s000000000010")
    sidecar.record(step=20, save_seconds=0.5, best_checkpoint="ckpt-s000000000010")
    sidecar.finish_attempt("completed", "budget reached")
    data = sidecar.to_dict()
    only = data["attempts"][0]
    assert only["steps_done"] == 20 and only["last_step"] == 20 and only["save_seconds"] == 0.75
    assert only["status"] == "completed" and only["exit_reason"] == "budget reached" and only["ended"]
    assert data["status"] == "completed" and data["step"] == 20 and data["epoch"] == 0
    assert data["latest_checkpoint"] == "ckpt-s000000000010" and data["best_checkpoint"] == "ckpt-s000000000010"


def test_summary_latest_min_max(tmp_path: Path):
    sidecar = make(tmp_path)
    start(sidecar)
    sidecar.record(step=10, metrics={"train": {"loss": 2.0}, "val": {"loss": 1.5, "acc": 0.4}})
    sidecar.record(step=20, metrics={"train": {"loss": 1.0}, "val": {"loss": 1.7, "acc": 0.6}})
    sidecar.record(step=30, metrics={"train": {"loss": torch.tensor(1.2)}})  # tensors and numpy scalars are fine
    summary = sidecar.to_dict()["summary"]
    assert summary["train/loss"] == {
        "latest": pytest.approx(1.2),
        "latest_step": 30,
        "min": 1.0,
        "min_step": 20,
        "max": 2.0,
        "max_step": 10,
    }
    assert summary["val/loss"] == {
        "latest": 1.7,
        "latest_step": 20,
        "min": 1.5,
        "min_step": 10,
        "max": 1.7,
        "max_step": 20,
    }
    assert summary["val/acc"]["max"] == 0.6 and summary["val/acc"]["max_step"] == 20


def test_metrics_without_step_use_the_last_step(tmp_path: Path):
    sidecar = make(tmp_path)
    start(sidecar, resumed_step=40)
    sidecar.record(step=50)
    sidecar.record(metrics={"val": {"loss": 0.5}})
    assert sidecar.to_dict()["summary"]["val/loss"]["latest_step"] == 50


def test_non_finite_values_are_null_and_never_best(tmp_path: Path):
    sidecar = make(tmp_path, hparams={"x": float("nan")})
    start(sidecar)
    sidecar.record(step=1, metrics={"train": {"loss": 1.0}})
    sidecar.record(step=2, metrics={"train": {"loss": float("nan")}})
    sidecar.record(step=3, metrics={"train": {"loss": float("inf")}})
    sidecar.write()
    text = (tmp_path / SIDECAR_NAME).read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = strict_load(tmp_path / SIDECAR_NAME)
    assert data["summary"]["train/loss"] == {
        "latest": None,
        "latest_step": 3,
        "min": 1.0,
        "min_step": 1,
        "max": 1.0,
        "max_step": 1,
    }
    assert data["hparams"] == {"x": None}


def test_resume_counts_lost_steps_and_keeps_history(tmp_path: Path):
    first = make(tmp_path)
    start(first)
    first.record(step=45, metrics={"val": {"loss": 0.3}})
    first.write()  # then SIGKILL: the attempt never finishes
    os.utime(tmp_path / HEARTBEAT_NAME, (1_700_000_000, 1_700_000_000))

    second = make(tmp_path, tags=["baseline", "resumed"])
    attempt = start(second, resumed_step=30, resumed_from="ckpt-s000000000030")
    assert (
        attempt["steps_lost"] == 15 and attempt["last_step"] == 30 and attempt["resumed_from"] == "ckpt-s000000000030"
    )
    data = second.to_dict()
    assert len(data["attempts"]) == 2 and data["status"] == "running"
    killed = data["attempts"][0]
    assert killed["status"] == "interrupted" and killed["ended"] == utc_stamp(1_700_000_000)
    assert data["summary"]["val/loss"]["min"] == 0.3  # history is kept
    assert data["tags"] == ["baseline", "resumed"]  # identity fields come from the new attempt
    second.record(step=60)
    assert second.current_attempt["steps_done"] == 30
    second.finish_attempt("preempted", "SIGTERM")
    second.write()

    third = make(tmp_path)
    assert start(third, resumed_step=60)["steps_lost"] == 0
    assert [a["status"] for a in third.to_dict()["attempts"]] == ["interrupted", "preempted", "running"]
    assert third.to_dict()["created"] == data["created"]


def test_a_resume_past_the_last_recorded_step_lost_nothing(tmp_path: Path):
    sidecar = make(tmp_path)
    start(sidecar)
    sidecar.record(step=10)
    sidecar.finish_attempt("stopped", "user asked")
    assert start(sidecar, resumed_step=12)["steps_lost"] == 0


@pytest.mark.parametrize("status", ["completed", "failed", "preempted", "stopped"])
def test_status_transitions(tmp_path: Path, status: str):
    sidecar = make(tmp_path)
    assert sidecar.status is None
    start(sidecar)
    assert sidecar.status == "running"
    sidecar.finish_attempt(status, "why")
    sidecar.write()
    assert read_sidecar(tmp_path / SIDECAR_NAME)["status"] == status


def test_finish_errors(tmp_path: Path):
    sidecar = make(tmp_path)
    with pytest.raises(PerdureError, match="before start_attempt"):
        sidecar.finish_attempt("completed", "x")
    start(sidecar)
    for status in ("running", "done", "stale"):
        with pytest.raises(PerdureError, match="completed, failed, preempted, stopped"):
            sidecar.finish_attempt(status, "x")


def test_corrupt_sidecar_is_moved_aside(tmp_path: Path, perdure_log: list[logging.LogRecord]):
    (tmp_path / SIDECAR_NAME).write_text('{"format": "perdure-sidecar/1", "run_id": ')
    sidecar = make(tmp_path)
    assert sidecar.to_dict()["attempts"] == []
    aside = list(tmp_path.glob(f"{SIDECAR_NAME}.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text().startswith('{"format"')
    assert not (tmp_path / SIDECAR_NAME).exists()
    assert any("not valid JSON" in r.getMessage() and aside[0].name in r.getMessage() for r in perdure_log)
    start(sidecar)
    sidecar.write()
    assert len(read_sidecar(tmp_path / SIDECAR_NAME)["attempts"]) == 1


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "not an object"),
        (b'{"format": "other/1"}', "format"),
        (b'{"format": "perdure-sidecar/1", "run_id": "x"}', "config_id"),
    ],
)
def test_read_sidecar_errors(tmp_path: Path, content: bytes, reason: str):
    path = tmp_path / SIDECAR_NAME
    path.write_bytes(content)
    with pytest.raises(SidecarError, match=reason) as info:
        read_sidecar(path)
    assert isinstance(info.value, PerdureError) and info.value.path == path
    with pytest.raises(SidecarError, match="missing"):
        read_sidecar(tmp_path / "nope.json")


def test_read_sidecar_rejects_unknown_status(tmp_path: Path):
    sidecar = make(tmp_path)
    sidecar.write()
    data = read_sidecar(tmp_path / SIDECAR_NAME)
    (tmp_path / SIDECAR_NAME).write_text(json.dumps({**data, "status": "exploded"}))
    with pytest.raises(SidecarError, match="exploded"):
        read_sidecar(tmp_path / SIDECAR_NAME)


def test_touch_heartbeat(tmp_path: Path):
    assert heartbeat_mtime(tmp_path) is None
    touch_heartbeat(tmp_path)
    os.utime(tmp_path / HEARTBEAT_NAME, (1_000, 1_000))
    assert heartbeat_mtime(tmp_path) == 1_000
    touch_heartbeat(tmp_path)
    assert heartbeat_mtime(tmp_path) > time.time() - 60


def test_effective_status_stale(tmp_path: Path):
    sidecar = make(tmp_path)
    start(sidecar)
    sidecar.write()
    data = read_sidecar(tmp_path / SIDECAR_NAME)
    assert effective_status(data, heartbeat_mtime(tmp_path)) == "running"
    old = time.time() - 3600
    os.utime(tmp_path / HEARTBEAT_NAME, (old, old))
    assert effective_status(data, heartbeat_mtime(tmp_path)) == "stale"
    assert effective_status(data, heartbeat_mtime(tmp_path), stale_after=7200) == "running"
    assert effective_status(data, 1_000.0, now=1_500.0, stale_after=600) == "running"
    assert effective_status(data, 1_000.0, now=1_601.0, stale_after=600) == "stale"
    sidecar.finish_attempt("completed", "done")
    assert effective_status(sidecar.to_dict(), old) == "completed"  # only a running run goes stale


def test_effective_status_without_heartbeat_uses_updated():
    running = {"status": "running", "updated": utc_stamp(1_000.0)}
    assert effective_status(running, None, now=1_100.0) == "running"
    assert effective_status(running, None, now=5_000.0) == "stale"
    assert effective_status({"status": "running"}, None) == "running"
    assert effective_status({"status": None}, None) == "unknown"


def test_utc_stamp_round_trip():
    assert utc_stamp(1_700_000_000.25) == "20231114T221320.250000Z"
    assert math.isclose(parse_stamp("20231114T221320.250000Z"), 1_700_000_000.25)
    assert parse_stamp("20231114T221320Z") == 1_700_000_000
    assert parse_stamp("yesterday") is None
