"""PERDURE_TRACEBACK=1 shows a PerdureError's traceback (the excepthook and the `perdure` command); `from_pretrained`
leaves the caller's config as it was."""

from __future__ import annotations

import sys

import pytest

from perdure import CheckpointError
from perdure.cli.main import main
from perdure.config import install_excepthook
from tests.runs import run_dir
from tests.scripts.resumable import ResumableRunner
from tests.scripts.resumable import make_config as resumable_config


def raise_perdure_error() -> None:
    raise CheckpointError("no checkpoint here")


def hook_output(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    install_excepthook()
    try:
        raise_perdure_error()
    except CheckpointError as error:
        sys.excepthook(type(error), error, error.__traceback__)
    return capsys.readouterr().err


def test_excepthook_prints_one_line_unless_perdure_traceback(monkeypatch, capsys) -> None:
    monkeypatch.delenv("PERDURE_TRACEBACK", raising=False)
    assert hook_output(monkeypatch, capsys) == "error: no checkpoint here\n"
    monkeypatch.setenv("PERDURE_TRACEBACK", "1")
    err = hook_output(monkeypatch, capsys)
    assert "Traceback (most recent call last)" in err and "raise_perdure_error" in err
    assert err.endswith("error: no checkpoint here\n")


def test_cli_shows_the_traceback_with_perdure_traceback(monkeypatch, capsys, tmp_path) -> None:
    missing = str(tmp_path / "nothing")
    monkeypatch.delenv("PERDURE_TRACEBACK", raising=False)
    assert main(["ckpt", "verify", missing]) == 2
    assert "Traceback" not in capsys.readouterr().err
    monkeypatch.setenv("PERDURE_TRACEBACK", "1")
    assert main(["ckpt", "verify", missing]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "error:" in err


def test_from_pretrained_does_not_change_the_callers_config(tmp_path) -> None:
    trained = ResumableRunner(resumable_config(tmp_path / "a", steps=4, **{"ckpt.interval": 4}))
    trained.train()
    trained.close()
    config = resumable_config(tmp_path / "b", steps=4, **{"workspace.id": "finetune"})
    before = config.to_plain()
    runner = ResumableRunner.from_pretrained(config, run_dir(tmp_path / "a") / "model.pth")
    assert runner.config.pretrained == str(run_dir(tmp_path / "a") / "model.pth")
    assert config.to_plain() == before
    runner.close()


def test_a_config_error_on_the_command_line_shows_its_traceback_with_perdure_traceback(monkeypatch, capsys) -> None:
    from perdure import RunnerConfig

    monkeypatch.setenv("PERDURE_TRACEBACK", "1")
    with pytest.raises(SystemExit):
        RunnerConfig().parse(["--steps", "5", "--precision", "fp8"])
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.endswith("error: config key 'precision' = 'fp8': use one of: fp32, bf16, fp16\n")
