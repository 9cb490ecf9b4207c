"""Only `train()` writes: looking at a run changes nothing on disk. A setup that fails is a visible failed run; bad
values of the user's own keys are refused before anything is written; weights that do not fit are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from perdure.cli.main import main as perdure_cli
from perdure.workspace.sidecar import read_sidecar
from tests.runs import assert_ok, run, run_dir
from tests.scripts.resumable import Config, ResumableRunner, make_config

pytestmark = pytest.mark.timeout(300)


def config(root: Path, **settings):
    return make_config(root, **{"steps": 12, "ckpt.interval": 4, **settings})


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root` with the bytes of each file (None for a directory)."""
    return {
        path.relative_to(root).as_posix(): (path.read_bytes() if path.is_file() else None)
        for path in sorted(root.rglob("*"))
    }


def listing(root: Path, capsys) -> str:
    capsys.readouterr()
    assert perdure_cli(["runs", "ls", "--root", str(root)]) == 0
    return capsys.readouterr().out


def test_looking_at_a_run_changes_nothing_on_disk(tmp_path, capsys):
    trained = ResumableRunner(config(tmp_path))
    trained.train()
    run = trained.run_dir.path
    before_ls = listing(tmp_path, capsys)
    before = snapshot(tmp_path)

    # its latest checkpoint, an older one (training it would branch a new run), and pretrained weights
    for target in (run, run / "checkpoints" / "ckpt-s000000000004"):
        looked = ResumableRunner.from_checkpoint(target, config_class=Config)
        assert looked.evaluate()["val"]["loss"] > 0
        assert len(looked.infer("val")) == 40
        looked.close()
    finetune = config(tmp_path, **{"workspace.id": "finetune", "optim.lr": 0.5})
    pretrained = ResumableRunner.from_pretrained(finetune, run / "model.pth")
    pretrained.evaluate()
    pretrained.close()
    ResumableRunner(config(tmp_path)).close()  # the run itself, built and closed without training

    assert snapshot(tmp_path) == before
    assert listing(tmp_path, capsys) == before_ls
    assert read_sidecar(run / "sidecar.json")["status"] == "completed"


def test_an_older_checkpoint_trains_into_a_branch_run(tmp_path):
    trained = ResumableRunner(config(tmp_path))
    trained.train()
    older = trained.run_dir.path / "checkpoints" / "ckpt-s000000000004"
    branch = ResumableRunner.from_checkpoint(older, config_class=Config)
    assert branch.global_step == 4
    assert not branch.run_dir.path.exists()  # named, not created, until it trains
    branch.train()
    assert branch.run_dir.path.name.endswith("-from-ckpt-s000000000004")
    assert read_sidecar(branch.run_dir.path / "sidecar.json")["status"] == "completed"
    assert read_sidecar(trained.run_dir.path / "sidecar.json")["attempts"].__len__() == 1


def test_a_failed_setup_is_a_failed_run_with_its_error(tmp_path, capsys):
    result = run("resumable.py", tmp_path, "--steps", "5", SETUP_FAIL="model")
    assert result.returncode != 0
    assert "cannot build the model: width 32 is reserved" in result.stderr
    (sidecar_path,) = tmp_path.glob("*/*/sidecar.json")
    sidecar = read_sidecar(sidecar_path)
    assert sidecar["status"] == "failed"
    assert "cannot build the model" in sidecar["attempts"][-1]["exit_reason"]
    # its wall time is goodput's too: start-up (the model was never built) and the rest, nothing trained or lost
    seconds = sidecar["attempts"][-1]["goodput"]["seconds"]
    assert seconds["startup"] > 0 and seconds["kept_training"] == seconds["lost_training"] == 0
    (log,) = (sidecar_path.parent / "logs").iterdir()
    assert "setup of run" in log.read_text() and "cannot build the model" in log.read_text()
    assert (sidecar_path.parent / "run.lock").read_text() == ""  # released
    shown = listing(tmp_path, capsys)
    assert "failed" in shown and sidecar["run_id"] in shown

    retried = run("resumable.py", tmp_path, "--steps", "5")  # fixed: the same run trains, its history kept
    assert_ok(retried)
    attempts = read_sidecar(sidecar_path)["attempts"]
    assert [attempt["status"] for attempt in attempts] == ["failed", "completed"]


def test_pretrained_weights_that_do_not_fit_are_named(tmp_path):
    assert_ok(run("resumable.py", tmp_path / "small", "--steps", "4", "--ckpt.interval", "4"))
    weights = run_dir(tmp_path / "small") / "model.pth"
    result = run("resumable.py", tmp_path / "wide", "--steps", "4", "--width", "48", "--pretrained", str(weights))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: the weights in") and "do not fit Sequential" in error
    assert "3 with another shape: 0.weight (32, 16) (model: (48, 16))" in error
    assert not (tmp_path / "wide").exists()  # refused as bad input, before anything was written: no run to list


def test_the_users_own_keys_are_checked_before_anything_is_written(tmp_path):
    result = run("resumable.py", tmp_path, "--steps", "5", "--dataset_size", "3")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: config key 'dataset_size' = 3: use at least 8 samples (one batch), e.g. --dataset_size 100"
    )
    assert not tmp_path.exists() or not any(tmp_path.iterdir())
