"""Kill -9 and resume with every logger on (metrics.csv, media, TensorBoard, W&B offline), in real processes.

Attempt 1 logs steps 1..27, checkpoints (a state.json) every 10 steps, flushes every 5, and SIGKILLs itself at step
27: steps 21..25 are on disk, 26..27 are not. Attempt 2 restores the state of step 20 and logs 21..40. Afterwards
each store holds every step exactly once, and both attempts are one W&B run.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from perdure.loggers.media import read_media_index
from perdure.loggers.metrics_csv import read_metrics_csv
from tests import zygote

ATTEMPT = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path

    import numpy as np

    from perdure.config import RunnerConfig
    from perdure.loggers.base import LoggerGroup
    from perdure.loggers.factory import build_loggers
    from perdure.runners.state import RunnerState

    run_dir, kill_at, end = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    config = RunnerConfig()
    config.steps = end
    config.tensorboard.enabled = True
    config.wandb.enabled = True
    config.wandb.mode = "offline"
    config.wandb.project = "perdure-tests"
    state = RunnerState()
    checkpoint = run_dir / "state.json"
    if checkpoint.exists():
        state.load_state_dict(json.loads(checkpoint.read_text()))
    loggers = LoggerGroup(build_loggers(config))
    loggers.open(run_dir, resumed_step=state.global_step, state=state, config=config)
    for step in range(state.global_step + 1, end + 1):
        loggers.log_metrics("train", {"loss": 1.0 / step, "lr": 0.1}, step)
        if step % 5 == 0:
            loggers.log_metrics("val", {"loss": 2.0 / step}, step)
            loggers.log_image("samples/grid", np.full((4, 6, 3), step / end), step)
            loggers.flush()
        if step % 10 == 0:
            loggers.flush(durable=True)
            state.global_step = step
            checkpoint.with_suffix(".tmp").write_text(json.dumps(state.state_dict()))
            os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    loggers.close()
    print(json.dumps({"wandb_run_id": state.wandb_run_id}))
    """
)


def run_attempt(script: Path, run_dir: Path, kill_at: int, end: int, home: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env.update(
        WANDB_MODE="offline",
        WANDB_DIR=str(home),
        WANDB_CACHE_DIR=str(home / "cache"),
        WANDB_CONFIG_DIR=str(home / "config"),
        WANDB_DATA_DIR=str(home / "data"),
        WANDB_DISABLE_GIT="true",
        PYTHONWARNINGS="default",  # show every Python warning, so the checks below see them
    )
    command = [sys.executable, str(script), str(run_dir), str(kill_at), str(end)]
    return zygote.run(command, env=env, capture_output=True, text=True, timeout=240)


def assert_no_warnings(stderr: str) -> None:
    lines = [line for line in stderr.splitlines() if "warn" in line.lower() or "error" in line.lower()]
    assert not lines, stderr


def wandb_history_steps(path: Path) -> list[int]:
    """The `_step` of every history row in a `.wandb` transaction log (LevelDB log format of W&B records)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, steps = path.read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or kind == 0:
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                steps.append(int(items["_step"]))
    return steps


@pytest.mark.timeout(600)
def test_kill_and_resume_every_logger(tmp_path):
    script = tmp_path / "attempt.py"
    script.write_text(ATTEMPT)
    run_dir = tmp_path / "runs" / "lineage-abc" / "abc-123"
    run_dir.mkdir(parents=True)

    killed = run_attempt(script, run_dir, kill_at=27, end=40, home=tmp_path / "wandb-home")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert_no_warnings(killed.stderr)
    stored_id = json.loads((run_dir / "state.json").read_text())["wandb_run_id"]
    assert stored_id and json.loads((run_dir / "state.json").read_text())["global_step"] == 20
    on_disk = read_metrics_csv(run_dir / "metrics.csv")
    assert max(step for step, *_ in on_disk) == 25  # the dead attempt got past its checkpoint

    resumed = run_attempt(script, run_dir, kill_at=-1, end=40, home=tmp_path / "wandb-home")
    assert resumed.returncode == 0, resumed.stderr
    assert_no_warnings(resumed.stderr)
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["wandb_run_id"] == stored_id

    rows = read_metrics_csv(run_dir / "metrics.csv")
    assert [step for step, split, name, _ in rows if (split, name) == ("train", "loss")] == list(range(1, 41))
    assert [step for step, split, *_ in rows if split == "val"] == list(range(5, 41, 5))
    assert len(rows) == len({(step, split, name) for step, split, name, _ in rows})

    records = read_media_index(run_dir)
    assert [record["step"] for record in records] == list(range(5, 41, 5))
    assert all((run_dir / record["path"]).is_file() for record in records)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    loss = accumulator.Scalars("train/loss")
    assert [event.step for event in loss] == list(range(1, 41))
    assert [event.value for event in loss] == pytest.approx([1.0 / step for step in range(1, 41)])
    assert [event.step for event in accumulator.Scalars("val/loss")] == list(range(5, 41, 5))
    assert [event.step for event in accumulator.Images("samples/grid")] == list(range(5, 41, 5))

    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [segment.name.rsplit("-", 1)[-1] for segment in segments] == [stored_id, stored_id]
    resumed_steps = wandb_history_steps(next(segments[-1].glob("run-*.wandb")))
    assert sorted(set(resumed_steps)) == list(range(21, 41))
