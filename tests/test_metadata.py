"""Run metadata: full / canonical / diff configs and git state, one copy per attempt, nothing overwritten."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from perdure.config import RunnerConfig
from perdure.errors import PerdureError
from perdure.workspace.identity import canonical_config
from perdure.workspace.metadata import METADATA_FILES, diff_against_defaults, write_metadata

FIRST = "20261122T023011.123456Z"
SECOND = "20261122T041500.000001Z"


class UserConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 100
        self.model_width = 64
        self.data.name = "toy"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "remote", "add", "origin", "https://example.com/team/project.git")
    (root / "train.py").write_text("print('hi')\n")
    git(root, "add", "train.py")
    git(root, "commit", "-q", "-m", "init")
    return root


def load(path: Path):
    return yaml.safe_load(path.read_text())


def test_files_and_contents(tmp_path: Path, repo: Path):
    config = UserConfig().parse(["--optim.lr", "0.5", "--workspace.root", str(tmp_path)], exit_on_error=False)
    metadata = write_metadata(tmp_path / "run", config, FIRST, code_path=repo)
    assert metadata == tmp_path / "run" / "metadata"
    for name in METADATA_FILES:
        assert (metadata / name).is_file()
        assert (metadata / "attempts" / FIRST / name).read_text() == (metadata / name).read_text()
    assert load(metadata / "config.full.yaml") == config.to_plain()
    assert load(metadata / "config.canonical.yaml") == canonical_config(config)
    assert "workspace" not in load(metadata / "config.canonical.yaml")
    git_yaml = load(metadata / "git.yaml")
    assert git_yaml["commit"] == git(repo, "rev-parse", "HEAD")
    assert git_yaml["branch"] == "main" and git_yaml["dirty"] is False
    assert git_yaml["remote"] == "https://example.com/team/project.git"
    assert "diff" not in git_yaml
    assert (metadata / "git.diff").read_text() == ""
    assert not [p for p in metadata.rglob(".*")]  # no temporary files left behind


def test_dirty_tree_diff(tmp_path: Path, repo: Path):
    (repo / "train.py").write_text("print('changed')\n")
    metadata = write_metadata(tmp_path / "run", UserConfig(), FIRST, code_path=repo)
    assert load(metadata / "git.yaml")["dirty"] is True
    diff = (metadata / "git.diff").read_text()
    assert "-print('hi')" in diff and "+print('changed')" in diff


def test_outside_git(tmp_path: Path):
    outside = tmp_path / "nogit"
    outside.mkdir()
    metadata = write_metadata(tmp_path / "run", UserConfig(), FIRST, code_path=outside)
    assert (metadata / "git.yaml").read_text() == "null\n"
    assert load(metadata / "git.yaml") is None
    assert (metadata / "git.diff").read_text() == ""


def test_diff_both_directions(tmp_path: Path, repo: Path):
    config = UserConfig().parse(["--optim.lr", "0.5", "--steps", "7"], exit_on_error=False)
    config.pop("model_width")  # a default key the config no longer holds
    config.extra.depth = 3  # a key the defaults lack
    metadata = write_metadata(tmp_path / "run", config, FIRST, code_path=repo)
    diff = load(metadata / "config.diff.yaml")
    assert diff["defaults"].endswith("UserConfig")
    assert diff["changed"] == {
        "optim.lr": {"default": 0.001, "value": 0.5},
        "steps": {"default": 100, "value": 7},
    }
    assert diff["added"] == {"extra.depth": {"value": 3}}
    assert diff["removed"] == {"model_width": {"default": 64}}


def test_diff_of_defaults_is_empty_and_types_count():
    assert diff_against_defaults(UserConfig()) == {
        "defaults": f"{__name__}.UserConfig",
        "changed": {},
        "added": {},
        "removed": {},
    }
    config = UserConfig()
    config.model_width = 64.0
    assert diff_against_defaults(config)["changed"] == {"model_width": {"default": 64, "value": 64.0}}


def test_diff_falls_back_to_runner_config_defaults():
    class NeedsArgs(RunnerConfig):
        def __init__(self, steps: int) -> None:
            super().__init__()
            self.steps = steps

    diff = diff_against_defaults(NeedsArgs(5))
    assert diff["defaults"] == "perdure.config.RunnerConfig"
    assert diff["changed"] == {"steps": {"default": None, "value": 5}}


def test_second_attempt_overwrites_nothing(tmp_path: Path, repo: Path):
    run = tmp_path / "run"
    write_metadata(run, UserConfig(), FIRST, code_path=repo)
    first = {name: (run / "metadata" / name).read_bytes() for name in METADATA_FILES}

    (repo / "train.py").write_text("print('edited between attempts')\n")
    extended = UserConfig().parse(["--steps", "200"], exit_on_error=False)  # a larger budget: the same run
    write_metadata(run, extended, SECOND, code_path=repo)

    assert {name: (run / "metadata" / name).read_bytes() for name in METADATA_FILES} == first
    assert {name: (run / "metadata" / "attempts" / FIRST / name).read_bytes() for name in METADATA_FILES} == first
    second = run / "metadata" / "attempts" / SECOND
    assert load(second / "config.full.yaml")["steps"] == 200
    assert load(run / "metadata" / "config.full.yaml")["steps"] == 100
    assert load(second / "git.yaml")["dirty"] is True and "edited" in (second / "git.diff").read_text()
    assert sorted(p.name for p in (run / "metadata" / "attempts").iterdir()) == [FIRST, SECOND]


def test_a_missing_top_level_file_is_filled_in(tmp_path: Path, repo: Path):
    run = tmp_path / "run"
    write_metadata(run, UserConfig(), FIRST, code_path=repo)
    (run / "metadata" / "git.diff").unlink()  # e.g. the first attempt died while writing
    full = (run / "metadata" / "config.full.yaml").read_text()
    write_metadata(run, UserConfig().parse(["--steps", "5"], exit_on_error=False), SECOND, code_path=repo)
    assert (run / "metadata" / "git.diff").exists()
    assert (run / "metadata" / "config.full.yaml").read_text() == full


@pytest.mark.parametrize("attempt", ["", "../escape", "a/b", ".hidden"])
def test_bad_attempt_name(tmp_path: Path, attempt: str):
    with pytest.raises(PerdureError, match="attempt"):
        write_metadata(tmp_path / "run", UserConfig(), attempt)
    assert not (tmp_path / "run").exists()
