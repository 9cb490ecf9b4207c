"""An async save's records (metrics.csv, media index, sidecar.json) are made durable off the training loop: on a
filesystem busy writing the next checkpoint's gigabytes an fsync can take seconds (a small fsync waited 0.18 s here
while 3 GB were written; on a network filesystem, more), and the loop reported each committed async save with three
of them, at the next save."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from perdure.runners.telemetry import BackgroundDurability
from tests.scripts.resumable import ResumableRunner, make_config

pytestmark = pytest.mark.timeout(120)


class RecordsItsLoop(ResumableRunner):
    """Knows whether it is between its first training step and its final save."""

    in_loop = False

    def train_step(self, batch):
        RecordsItsLoop.in_loop = True
        return super().train_step(batch)

    def save_checkpoint(self, reason):
        if reason == "final":
            RecordsItsLoop.in_loop = False
        return super().save_checkpoint(reason)


def test_an_async_run_fsyncs_nothing_on_its_training_thread_between_its_first_step_and_its_final_save(
    tmp_path, monkeypatch
):
    calls: list[tuple[str, bool]] = []
    fsync = os.fsync

    def recording(descriptor):
        calls.append((threading.current_thread().name, RecordsItsLoop.in_loop))
        return fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording)
    settings = {"steps": 12, "ckpt.interval": 3, "log.interval": 2, "ckpt.async_mode": "thread"}
    runner = RecordsItsLoop(make_config(tmp_path, **settings))
    runner.train()
    in_loop = [name for name, looping in calls if looping]
    assert "MainThread" not in in_loop, in_loop
    assert "perdure-durability" in in_loop, "the committed saves' records were never made durable"
    assert "perdure-checkpoint-writer" in in_loop
    rows = (runner.run_dir.path / "metrics.csv").read_text().splitlines()
    assert any(row.startswith("12,train,loss,") for row in rows)


def test_requests_made_while_the_work_runs_coalesce_into_one_more_run_and_wait_waits_for_it():
    started, release, runs = threading.Event(), threading.Event(), []

    def work():
        runs.append(1)
        started.set()
        release.wait(10)

    durability = BackgroundDurability(work)
    durability.request()
    assert started.wait(10)
    for _ in range(5):
        durability.request()  # while the first run is under way
    waiting = threading.Thread(target=durability.wait)
    waiting.start()
    waiting.join(0.2)
    assert waiting.is_alive(), "wait() returned before the work was done"
    release.set()
    waiting.join(10)
    assert not waiting.is_alive() and len(runs) == 2


def test_a_failure_of_the_work_is_a_warning_and_the_next_request_runs_again(caplog):
    runs = []

    def work():
        runs.append(1)
        raise OSError(28, "No space left on device")

    durability = BackgroundDurability(work)
    with caplog.at_level(logging.WARNING, logger="perdure"):
        durability.request()
        durability.wait()
        durability.request()
        durability.wait()
    assert len(runs) == 2 and "making the run's records durable failed" in caplog.text
