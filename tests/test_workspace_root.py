"""Workspace root resolution: --workspace.root > $PERDURE_ROOT > config file / code > ./runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from perdure.config import RunnerConfig
from perdure.workspace.identity import canonical_config, config_id
from perdure.workspace.run_dir import DEFAULT_ROOT, ROOT_ENV, resolve_run_dir, workspace_root


class UserConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 10


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROOT_ENV, raising=False)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"workspace": {"root": str(tmp_path / "from-file")}}))
    return path


def parse(*args: str, config: RunnerConfig | None = None) -> RunnerConfig:
    return (config or UserConfig()).parse(list(args), exit_on_error=False)


def test_default_is_runs():
    assert workspace_root(parse()) == Path(DEFAULT_ROOT)
    assert workspace_root(None) == Path(DEFAULT_ROOT)


def test_config_file_is_used(config_file: Path, tmp_path: Path):
    assert workspace_root(parse("--config", str(config_file))) == tmp_path / "from-file"


def test_set_in_code_is_used(tmp_path: Path):
    config = UserConfig()
    config.workspace.root = str(tmp_path / "in-code")
    assert workspace_root(parse(config=config)) == tmp_path / "in-code"


def test_env_beats_config_file_and_code(config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "from-env"))
    assert workspace_root(parse("--config", str(config_file))) == tmp_path / "from-env"
    config = UserConfig()
    config.workspace.root = str(tmp_path / "in-code")
    assert workspace_root(parse(config=config)) == tmp_path / "from-env"
    assert workspace_root(parse()) == tmp_path / "from-env"
    assert workspace_root(None) == tmp_path / "from-env"


@pytest.mark.parametrize("form", ["space", "equals"])
def test_command_line_beats_env_and_file(config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "from-env"))
    cli = str(tmp_path / "from-cli")
    option = ["--workspace.root", cli] if form == "space" else [f"--workspace.root={cli}"]
    config = parse("--config", str(config_file), *option)
    assert workspace_root(config) == tmp_path / "from-cli"


def test_command_line_none_falls_back(config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`--workspace.root none` clears the value: the environment, then the default, decide."""
    config = parse("--config", str(config_file), "--workspace.root", "none")
    assert workspace_root(config) == Path(DEFAULT_ROOT)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "from-env"))
    assert workspace_root(config) == tmp_path / "from-env"


def test_an_explicit_path_is_returned_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "from-env"))
    assert workspace_root(str(tmp_path / "given")) == tmp_path / "given"
    assert workspace_root(tmp_path / "given") == tmp_path / "given"


def test_plain_mapping_has_no_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    plain = {"workspace": {"root": str(tmp_path / "stored")}}
    assert workspace_root(plain) == tmp_path / "stored"
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "from-env"))
    assert workspace_root(plain) == tmp_path / "from-env"


def test_resolve_run_dir_follows_the_precedence(config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "from-env"))
    from_env = resolve_run_dir(parse("--config", str(config_file)), "MLPRunner")
    assert from_env.path.parent.parent == tmp_path / "from-env"
    from_cli = resolve_run_dir(parse("--workspace.root", str(tmp_path / "from-cli")), "MLPRunner")
    assert from_cli.path.parent.parent == tmp_path / "from-cli"
    assert from_cli.run_id == from_env.run_id  # where a run lives is not part of its identity


def test_command_line_keys_are_recorded_but_not_config_keys(config_file: Path, tmp_path: Path):
    config = parse("--config", str(config_file), "--workspace.root", str(tmp_path / "cli"), "--optim.lr", "0.5")
    assert config.command_line_keys() == {"workspace.root", "optim.lr"}
    assert config.from_command_line("workspace.root") and not config.from_command_line("steps")
    plain = config.to_plain()
    text = yaml.safe_dump(plain) + config.yamls()
    assert "cli_keys" not in text and "cli_keys" not in str(canonical_config(config))
    assert "_perdure_cli_keys" not in config.known_keys()
    same = UserConfig()
    same.optim.lr = 0.5
    assert config_id(config) == config_id(same)


def test_file_keys_are_not_command_line_keys(config_file: Path):
    config = parse("--config", str(config_file))
    assert config.command_line_keys() == frozenset()
    assert UserConfig().command_line_keys() == frozenset()


def test_command_line_keys_accumulate_over_parses(tmp_path: Path):
    config = parse("--optim.lr", "0.5")
    config.parse(["--seed", "3"], exit_on_error=False)
    assert config.command_line_keys() == {"optim.lr", "seed"}
