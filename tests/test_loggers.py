"""Unit tests of the metric loggers: metrics.csv, media, PNG, TensorBoard, the progress bar, the factory."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from perdure.config import RunnerConfig
from perdure.errors import ConfigError
from perdure.loggers import factory as loggers_factory
from perdure.loggers.base import LoggerGroup, to_image_array
from perdure.loggers.factory import build_loggers
from perdure.loggers.images import PNG_SIGNATURE, ImageFormatError, encode_png
from perdure.loggers.media import MediaLogger, read_media_index, safe_tag
from perdure.loggers.metrics_csv import HEADER, MetricsCSV, read_metrics_csv
from perdure.loggers.progress import ProgressBar
from perdure.loggers.tensorboard_logger import TensorBoardLogger
from perdure.runners.state import RunnerState
from tests.disks import fill, mount_or_skip, unmount


def open_logger(logger, run_dir: Path, resumed_step: int = 0):
    logger.open(run_dir, resumed_step=resumed_step, state=RunnerState(global_step=resumed_step), config=RunnerConfig())
    return logger


def log_steps(logger, steps, flush_every: int = 5) -> None:
    for step in steps:
        logger.log_metrics("train", {"loss": 1.0 / step, "lr": 0.5}, step)
        if step % flush_every == 0:
            logger.log_metrics("val", {"loss": 2.0 / step}, step)
            logger.flush()


# ---------------------------------------------------------------------- images and PNG


def decode_png(data: bytes) -> np.ndarray:
    """A tiny PNG reader for what `encode_png` writes (8-bit, filter 0), checking every chunk's CRC."""
    assert data[:8] == PNG_SIGNATURE
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    assert list(chunks)[-1] == b"IEND"
    width, height, depth, color, *_ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert depth == 8
    channels = {0: 1, 2: 3, 6: 4}[color]
    raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), dtype=np.uint8).reshape(height, 1 + width * channels)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, channels)


@pytest.mark.parametrize(
    ("image", "shape"),
    [
        (np.zeros((5, 7)), (5, 7, 1)),
        (np.zeros((5, 7, 3), dtype=np.uint8), (5, 7, 3)),
        (np.zeros((4, 5, 7)), (5, 7, 4)),
        (torch.zeros(3, 5, 7), (5, 7, 3)),
        (torch.zeros(1, 3, 5, 7), (5, 7, 3)),
        (torch.zeros(3, 5, 3), (5, 3, 3)),  # ambiguous: a tensor reads as CHW
        (np.zeros((3, 5, 3)), (3, 5, 3)),  # ambiguous: an array reads as HWC
        (torch.zeros(5, 7, dtype=torch.bfloat16), (5, 7, 1)),
    ],
)
def test_to_image_array_layouts(image, shape):
    array = to_image_array(image)
    assert array.shape == shape and array.dtype == np.uint8 and array.flags.c_contiguous


def test_to_image_array_values():
    floats = np.array([[-1.0, 0.0, 0.5, 1.0, 2.0, np.nan]])
    assert to_image_array(floats)[0, :, 0].tolist() == [0, 0, 128, 255, 255, 0]
    assert to_image_array(np.array([[True, False]]))[0, :, 0].tolist() == [255, 0]
    assert to_image_array(np.array([[3, 200]], dtype=np.int64))[0, :, 0].tolist() == [3, 200]
    chw = torch.arange(24, dtype=torch.uint8).reshape(3, 2, 4)
    assert np.array_equal(to_image_array(chw), chw.numpy().transpose(1, 2, 0))


@pytest.mark.parametrize(
    "bad", [np.zeros((5, 7, 2)), np.zeros((2, 3, 4, 5)), np.zeros((0, 3)), np.array([[300]]), [[0.0]]]
)
def test_to_image_array_rejects(bad):
    with pytest.raises(ImageFormatError):
        to_image_array(bad)


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_png_round_trip(channels):
    image = np.random.default_rng(channels).integers(0, 256, size=(9, 13, channels), dtype=np.uint8)
    data = encode_png(image)
    assert data.startswith(PNG_SIGNATURE)
    assert np.array_equal(decode_png(data), image)
    from PIL import Image

    decoded = np.asarray(Image.open(io.BytesIO(data)))
    assert np.array_equal(decoded.reshape(image.shape), image)


def test_png_known_chunks():
    """A 1x1 grey pixel: IHDR and IEND are byte-for-byte the well-known chunks (their CRCs included)."""
    data = encode_png(np.full((1, 1, 1), 255, dtype=np.uint8))
    assert data.startswith(PNG_SIGNATURE + bytes.fromhex("0000000d49484452000000010000000108000000003a7e9b55"))
    assert data.endswith(bytes.fromhex("0000000049454e44ae426082"))
    assert decode_png(data).tolist() == [[[255]]]


# ---------------------------------------------------------------------- metrics.csv


def test_metrics_csv_fresh_run(tmp_path):
    logger = open_logger(MetricsCSV(), tmp_path)
    log_steps(logger, range(1, 11))
    logger.close()
    logger.close()  # idempotent
    text = (tmp_path / "metrics.csv").read_text()
    assert text.splitlines()[0] == HEADER and text.count(HEADER) == 1
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert rows[:2] == [(1, "train", "loss", 1.0), (1, "train", "lr", 0.5)]
    assert [row for row in rows if row[1] == "val"] == [(5, "val", "loss", 0.4), (10, "val", "loss", 0.2)]
    assert all(value == 1.0 / step for step, split, name, value in rows if (split, name) == ("train", "loss"))


def test_metrics_csv_resume_drops_rows_after_checkpoint(tmp_path):
    killed = open_logger(MetricsCSV(), tmp_path)
    log_steps(killed, range(1, 28))  # flushed up to 25; 26 and 27 still buffered when the process "dies"
    killed.flush()  # ... or not: either way rows 21..27 must go
    with (tmp_path / "metrics.csv").open("a") as stream:
        stream.write("27,train,lo")  # a row torn by the kill
    resumed = open_logger(MetricsCSV(), tmp_path, resumed_step=20)
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert max(step for step, *_ in rows) == 20
    log_steps(resumed, range(21, 41))
    resumed.close()
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    train_steps = [step for step, split, name, _ in rows if (split, name) == ("train", "loss")]
    assert train_steps == list(range(1, 41))
    assert [step for step, split, *_ in rows if split == "val"] == list(range(5, 41, 5))
    assert (tmp_path / "metrics.csv").read_text().count(HEADER) == 1


def test_metrics_csv_resumed_twice_and_fresh_restart(tmp_path):
    first = open_logger(MetricsCSV(), tmp_path)
    log_steps(first, range(1, 16))
    first.close()
    second = open_logger(MetricsCSV(), tmp_path, resumed_step=10)
    log_steps(second, range(11, 31))
    second.close()
    third = open_logger(MetricsCSV(), tmp_path, resumed_step=25)
    log_steps(third, range(26, 36))
    third.close()
    rows = read_metrics_csv(tmp_path / "metrics.csv")
    assert [step for step, split, name, _ in rows if name == "lr"] == list(range(1, 36))
    assert len(rows) == len(set((step, split, name) for step, split, name, _ in rows))
    untouched = (tmp_path / "metrics.csv").stat().st_mtime_ns
    open_logger(MetricsCSV(), tmp_path, resumed_step=35).close()  # nothing to cut: the file is not rewritten
    assert (tmp_path / "metrics.csv").stat().st_mtime_ns == untouched
    open_logger(MetricsCSV(), tmp_path, resumed_step=0).close()  # a fresh start keeps nothing of a dead attempt
    assert (tmp_path / "metrics.csv").read_text() == HEADER + "\n"


def test_metrics_csv_unwritten_header_and_odd_names(tmp_path):
    (tmp_path / "metrics.csv").write_text("")
    (tmp_path / ".metrics.csv.999.tmp").write_text("left by a kill during a rewrite")
    logger = open_logger(MetricsCSV(), tmp_path)
    assert not (tmp_path / ".metrics.csv.999.tmp").exists()
    logger.log_metrics("val", {"acc, top-1": np.float32(0.25), "multi\nline": torch.tensor(2.0)}, 3)
    logger.close()
    assert read_metrics_csv(tmp_path / "metrics.csv") == [(3, "val", "acc, top-1", 0.25), (3, "val", "multi line", 2.0)]


# ---------------------------------------------------------------------- media


def test_safe_tag():
    assert safe_tag("val/recon image:1") == "val_recon_image_1"
    assert safe_tag("ok-name_1.0") == "ok-name_1.0"
    assert safe_tag("..") == "_"


def test_media_logger_writes_png_and_index(tmp_path):
    logger = open_logger(MediaLogger(), tmp_path)
    logger.log_metrics("train", {"loss": 1.0}, 1)  # ignored
    rgb = np.random.default_rng(0).integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
    logger.log_image("val/recon", rgb, 12)
    logger.log_image("val/recon", torch.rand(1, 6, 8), 12, index=1)
    logger.close()
    assert (tmp_path / "media/val_recon/00000012_0.png").is_file()
    assert np.array_equal(decode_png((tmp_path / "media/val_recon/00000012_0.png").read_bytes()), rgb)
    assert decode_png((tmp_path / "media/val_recon/00000012_1.png").read_bytes()).shape == (6, 8, 1)
    assert read_media_index(tmp_path) == [
        {"step": 12, "tag": "val/recon", "index": 0, "path": "media/val_recon/00000012_0.png", "shape": [6, 8, 3]},
        {"step": 12, "tag": "val/recon", "index": 1, "path": "media/val_recon/00000012_1.png", "shape": [6, 8, 1]},
    ]


def test_media_logger_resume_drops_later_images(tmp_path):
    killed = open_logger(MediaLogger(), tmp_path)
    for step in (10, 20, 30):
        killed.log_image("samples", np.zeros((2, 2)), step)
    killed.flush()
    resumed = open_logger(MediaLogger(), tmp_path, resumed_step=20)
    assert not (tmp_path / "media/samples/00000030_0.png").exists()
    resumed.log_image("samples", np.ones((2, 2)), 30)
    resumed.close()
    assert [record["step"] for record in read_media_index(tmp_path)] == [10, 20, 30]
    assert decode_png((tmp_path / "media/samples/00000030_0.png").read_bytes()).max() == 255


def test_no_media_without_images(tmp_path):
    open_logger(MediaLogger(), tmp_path).close()
    assert not (tmp_path / "media").exists()
    assert read_media_index(tmp_path) == []


# ---------------------------------------------------------------------- TensorBoard


def read_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0})
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_tensorboard_resume_in_process_has_no_fold_back(tmp_path):
    """An abandoned writer (flushed to step 25, never closed) then a resume from step 20; see also the SIGKILL test."""
    killed = open_logger(TensorBoardLogger(), tmp_path)
    log_steps(killed, range(1, 28))
    resumed = open_logger(TensorBoardLogger(), tmp_path, resumed_step=20)
    log_steps(resumed, range(21, 41))
    resumed.close()
    killed.writer.close()  # late: its buffered steps 26 and 27 land in the old file, and are still purged
    loss = read_scalars(tmp_path / "tensorboard", "train/loss")
    assert [step for step, _ in loss] == list(range(1, 41))
    assert [value for _, value in loss] == pytest.approx([1.0 / step for step in range(1, 41)])
    assert [step for step, _ in read_scalars(tmp_path / "tensorboard", "val/loss")] == list(range(5, 41, 5))


def test_tensorboard_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = open_logger(TensorBoardLogger(), tmp_path)
    image = np.random.default_rng(1).integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
    logger.log_image("val/sample", image, 7)
    logger.log_image("val/sample", image[:, :, :1], 7, index=2)
    logger.close()
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    (event,) = accumulator.Images("val/sample")
    assert (event.step, event.width, event.height) == (7, 5, 4)
    assert np.array_equal(decode_png(event.encoded_image_string), image)
    assert accumulator.Images("val/sample_2")[0].step == 7


# ---------------------------------------------------------------------- progress bar


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_draws_nothing_off_a_terminal():
    for stream, mode in ((io.StringIO(), "auto"), (Terminal(), "lines")):
        bar = ProgressBar(100, mode=mode, stream=stream)
        for step in range(1, 101):
            bar.update(step, {"loss": 0.5})
        bar.clear()
        bar.redraw()
        bar.close()
        assert stream.getvalue() == "" and not bar.enabled
    assert ProgressBar(10, mode="bar", stream=io.StringIO()).enabled


def test_progress_bar_on_a_terminal_rate_and_eta():
    clock, stream = FakeClock(), Terminal()
    bar = ProgressBar(1000, initial=100, stream=stream, clock=clock, width=200)  # resumed at step 100
    assert bar.enabled and bar.rate() is None and bar.eta() is None
    clock.now += 4.0
    bar.update(120, {"loss": 0.12344})
    assert bar.rate() == pytest.approx(5.0)  # 20 steps in 4 s: the steps before the resume do not count
    assert bar.eta() == pytest.approx(176.0)
    line = stream.getvalue()
    assert line == "\rstep 120/1000  12% | 5.0 steps/s | loss 0.1234 | ETA 0:02:56"
    clock.now += 0.01
    bar.update(121)  # within min_interval: not redrawn
    assert stream.getvalue() == line
    clock.now += 1.0
    bar.update(1000)
    bar.close()
    bar.close()
    final = "\rstep 1000/1000 100% | 179.6 steps/s | loss 0.1234 | ETA 0:00:00"  # 900 steps in 5.01 s
    assert stream.getvalue() == line + final + "\n"  # the last step is drawn at once; close() ends the line


def test_progress_bar_slow_steps_and_unknown_total():
    clock, stream = FakeClock(), Terminal()
    bar = ProgressBar(None, stream=stream, clock=clock)
    clock.now += 30.0
    bar.update(3)
    assert stream.getvalue() == "\rstep 3 | 10.0 s/step"


def test_progress_bar_makes_way_for_log_lines():
    clock, stream = FakeClock(), Terminal()
    bar = ProgressBar(10, stream=stream, clock=clock, width=30)
    clock.now += 1.0
    bar.update(5, {"loss": 1.0})
    drawn = stream.getvalue()
    assert drawn.startswith("\rstep 5/10  50%") and len(drawn) == 30  # cut to the terminal's width - 1
    with bar.suspended():
        stream.write("12:00:00 INFO a log line\n")
    after = stream.getvalue()[len(drawn) :]
    assert after == "\r" + " " * 29 + "\r" + "12:00:00 INFO a log line\n" + drawn
    stream.seek(0)
    stream.truncate()
    bar.clear()
    bar.clear()  # nothing shown any more: nothing to erase
    assert stream.getvalue() == "\r" + " " * 29 + "\r"


def test_progress_bar_rejects_unknown_mode():
    with pytest.raises(ValueError, match="auto, bar, lines"):
        ProgressBar(10, mode="fancy")


# ---------------------------------------------------------------------- factory and group


def test_build_loggers_follows_the_config(monkeypatch):
    config = RunnerConfig()
    assert [type(logger).__name__ for logger in build_loggers(config)] == ["MetricsCSV", "MediaLogger"]
    config.tensorboard.enabled = True
    config.wandb.enabled = True
    names = [type(logger).__name__ for logger in build_loggers(config)]
    assert names == ["MetricsCSV", "MediaLogger", "TensorBoardLogger", "WandbLogger"]
    config.wandb.mode = "disabled"
    assert "WandbLogger" not in [type(logger).__name__ for logger in build_loggers(config)]
    config.wandb.mode = "offline"
    real_find_spec = loggers_factory.importlib.util.find_spec
    monkeypatch.setattr(
        loggers_factory.importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name)
    )
    with pytest.raises(ConfigError, match="wandb.enabled.*pip install wandb.*--wandb.enabled false"):
        build_loggers(config)


def test_logger_group_fans_out(tmp_path):
    group = LoggerGroup(build_loggers(RunnerConfig()))
    group.open(tmp_path, resumed_step=0, state=RunnerState(), config=RunnerConfig())
    group.log_metrics("train", {"loss": torch.tensor(0.25)}, 1)
    group.log_image("grid", torch.ones(3, 2, 2), 1)
    group.flush(durable=True)
    group.close()
    assert read_metrics_csv(tmp_path / "metrics.csv") == [(1, "train", "loss", 0.25)]
    assert json.loads((tmp_path / "media.jsonl").read_text())["shape"] == [2, 2, 3]
    assert len(group) == 2


def test_logger_group_on_a_full_disk_warns_once_per_logger_and_closes(tmp_path, caplog):
    disk = tmp_path / "disk"
    mount_or_skip(disk, "size=64k")
    try:
        group = LoggerGroup(build_loggers(RunnerConfig()))
        group.open(disk, resumed_step=0, state=RunnerState(), config=RunnerConfig())
        fill(disk / "other-job")
        for step in range(1, 2000):  # more rows than the CSV writer buffers
            group.log_metrics("train", {"loss": 0.5}, step)
        group.flush(durable=True)
        group.log_metrics("train", {"loss": 0.5}, 2000)
        group.close()  # what is still buffered cannot be written: a warning, never an error over the run's outcome
    finally:
        unmount(disk)
    warnings = [record.getMessage() for record in caplog.records if "could not write" in record.getMessage()]
    assert warnings == ["MetricsCSV could not write ([Errno 28] No space left on device); training goes on"]


# ---------------------------------------------------------------------- W&B (the real one: test_loggers_resume)


class FakeRun:
    def __init__(self, starting_step: int) -> None:
        self.starting_step = starting_step
        self.logged: list[tuple[int, dict]] = []
        self.finished = 0

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, data))

    def finish(self, exit_code: int | None = None) -> None:
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    import wandb

    calls: list[dict] = []

    def init(**kwargs):
        calls.append(kwargs)
        return FakeRun(starting_step=FakeRun.next_start)

    FakeRun.next_start = 0
    monkeypatch.setattr(wandb, "init", init)
    return calls


def test_wandb_logger_id_lives_in_the_state(tmp_path, fake_wandb, capsys):
    from perdure.loggers.wandb_logger import WandbLogger

    config = RunnerConfig()
    config.wandb.mode = "offline"
    config.wandb.project = "demo"
    config.workspace.tags = ["baseline"]
    run_dir = tmp_path / "mlp-abc1234" / "abc1234-0123456789ab"
    state = RunnerState()
    fresh = WandbLogger()
    fresh.open(run_dir, resumed_step=0, state=state, config=config)
    run_id = state.wandb_run_id
    assert run_id and len(run_id) == 8 and run_id.isalnum()
    call = fake_wandb[0]
    assert call["id"] == run_id and call["resume"] == "allow" and call["mode"] == "offline"
    assert (call["project"], call["dir"], call["name"], call["group"]) == (
        "demo",
        str(run_dir),
        "abc1234-0123456789ab",
        "mlp-abc1234",
    )
    assert call["tags"] == ["baseline"] and call["reinit"] == "create_new"
    assert "wandb" not in call["config"] and call["config"]["optim"]["lr"] == config.optim.lr  # canonical hparams
    fresh.log_metrics("train", {"loss": 0.5}, 10)
    fresh.log_image("grid", np.zeros((2, 2, 1), dtype=np.uint8), 10)
    run = fresh.run
    fresh.close()
    fresh.close()
    assert [step for step, _ in run.logged] == [10, 10] and run.finished == 1
    assert set(run.logged[1][1]) == {"grid"}

    FakeRun.next_start = 31  # online, the server holds steps up to 30 (the dead attempt got that far)
    resumed = WandbLogger()
    state = RunnerState(global_step=20, wandb_run_id=run_id)
    capsys.readouterr()
    resumed.open(run_dir, resumed_step=20, state=state, config=config)
    run = resumed.run
    for step in range(21, 36):
        resumed.log_metrics("train", {"loss": 1.0 / step}, step)
    assert fake_wandb[1]["id"] == run_id and state.wandb_run_id == run_id
    assert [step for step, _ in run.logged] == list(range(31, 36))
    assert run.logged[0][1] == {"train/loss": 1.0 / 31}
    said = capsys.readouterr().out
    assert "steps 21..30 logged again by this resume are skipped" in said and "WARNING" not in said
    resumed.log_metrics("val", {"loss": 1.0}, 33)  # out of order within an attempt: one warning, then silence
    resumed.log_metrics("val", {"loss": 1.0}, 34)
    assert capsys.readouterr().out.count("WARNING") == 1
    resumed.close()
    assert run.finished == 1

    rewinding = WandbLogger(rewind=True)
    rewinding.open(run_dir, resumed_step=20, state=state, config=config)
    assert fake_wandb[2]["resume_from"] == f"{run_id}?_step=20" and "resume" not in fake_wandb[2]
