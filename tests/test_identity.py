"""Run identity: canonical config, config_id, config_diff, code_id and git_state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from perdure.config import RunnerConfig
from perdure.errors import CodeIdentityError
from perdure.workspace.identity import canonical_config, code_id, config_diff, config_id, git_state


class UserConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 100
        self.model_width = 64


def make(*args: str) -> UserConfig:
    return UserConfig().parse(list(args), exit_on_error=False)


# ---------------------------------------------------------------------- canonical config and config_id


def test_canonical_keeps_the_maths_only():
    config = make("--dataloader.val.batch_size", "8", "--dataloader.val.num_workers", "2")
    config.tensorboard.enabled = True
    config.dist.backend = "gloo"
    canonical = canonical_config(config)
    for key in ("workspace", "log", "ckpt", "checkpoint", "resume", "pretrained", "steps", "epochs"):
        assert key not in canonical
    for key in ("tensorboard", "dist", "wandb", "resilience"):
        assert key not in canonical
    assert "num_workers" not in canonical["dataloader"] and "pin_memory" not in canonical["dataloader"]
    assert canonical["dataloader"]["val"] == {"batch_size": 8}
    assert canonical["optim"]["lr"] == 1e-3 and canonical["model_width"] == 64 and canonical["seed"] == 0
    assert canonical["dataloader"]["batch_size"] == 32 and canonical["stack"] == "torch"


def test_canonical_drops_empty_sections():
    config = make()
    _ = config.never_set  # chanfig creates an empty section on this read
    assert "never_set" not in canonical_config(config)
    assert canonical_config({"a": {}, "b": {"c": {}}, "d": 1}) == {"d": 1}


def test_config_id_stable_and_sensitive():
    base = config_id(make())
    assert len(base) == 12 and int(base, 16) >= 0
    assert config_id(make()) == base
    assert config_id(make("--optim.lr", "3e-4")) != base
    assert config_id(make("--model_width", "65")) != base
    extra = make()
    extra.new_key = 1
    assert config_id(extra) != base


def test_config_id_ignores_budget_and_bookkeeping(tmp_path):
    base = config_id(make())
    assert config_id(make("--steps", "5000")) == base
    weights = tmp_path / "w.pth"
    weights.write_bytes(b"")
    same = make(
        "--workspace.root",
        str(tmp_path),
        "--log.interval",
        "1",
        "--resume",
        "--pretrained",
        str(weights),
        "--ckpt.interval",
        "7",
        "--ckpt.keep_latest_k",
        "2",
        "--dataloader.num_workers",
        "4",
        "--dataloader.pin_memory",
        "--dataloader.train.num_workers",
        "3",
    )
    assert config_id(same) == base


def test_config_id_independent_of_key_order_and_container_type():
    a = {"optim": {"lr": 0.1, "name": "sgd"}, "seed": 1}
    b = {"seed": 1, "optim": {"name": "sgd", "lr": 0.1}}
    assert config_id(a) == config_id(b)
    assert config_id(make()) == config_id(make().to_plain())
    assert config_id({"x": 1}) != config_id({"x": 1.0})  # types count


def test_config_id_stable_across_processes():
    code = (
        "from perdure.workspace.identity import config_id;"
        "print(config_id({'optim': {'lr': 0.001, 'betas': [0.9, 0.999]}, 'seed': 0, 'model': 'x'}))"
    )
    root = Path(__file__).resolve().parents[1]
    ids = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            cwd=root,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": str(root)},
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(ids) == 1
    assert ids == {config_id({"seed": 0, "model": "x", "optim": {"betas": [0.9, 0.999], "lr": 0.001}})}


# ---------------------------------------------------------------------- config_diff


def test_config_diff_both_directions():
    old = {"optim": {"lr": 0.001, "name": "adamw"}, "foo": 1}
    new = {"optim": {"lr": 0.0003, "name": "adamw"}, "bar": 2}
    assert config_diff(old, new, a_label="checkpoint", b_label="current") == [
        "only in current: bar = 2",
        "only in checkpoint: foo = 1",
        "optim.lr: 0.001 (checkpoint) != 0.0003 (current)",
    ]
    assert config_diff(new, old, "a", "b") == [
        "only in a: bar = 2",
        "only in b: foo = 1",
        "optim.lr: 0.0003 (a) != 0.001 (b)",
    ]
    assert config_diff(old, old) == []


def test_config_diff_of_canonical_configs():
    a, b = canonical_config(make()), canonical_config(make("--optim.name", "sgd", "--steps", "9"))
    assert config_diff(a, b) == ['optim.name: "adamw" (checkpoint) != "sgd" (current)']


# ---------------------------------------------------------------------- code_id and git_state


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
    git(root, "init", "-q")
    (root / "train.py").write_text("print('hi')\n")
    (root / "data.bin").write_bytes(b"\x00\x01\x02")
    git(root, "add", "train.py", "data.bin")
    git(root, "commit", "-q", "-m", "init")
    return root


def test_code_id_clean_repo(repo: Path):
    sha = git(repo, "rev-parse", "HEAD")
    assert code_id(repo) == sha[:7]
    assert code_id(str(repo / "train.py")) == sha[:7]  # a file inside the repo
    sub = repo / "pkg"
    sub.mkdir()
    assert code_id(sub) == sha[:7]  # found from a subdirectory


def test_code_id_dirty_tracked_file(repo: Path):
    sha = git(repo, "rev-parse", "HEAD")[:7]
    (repo / "train.py").write_text("print('changed')\n")
    first = code_id(repo)
    assert first is not None and first.startswith(f"{sha}-d") and len(first) == 7 + 2 + 10
    assert code_id(repo) == first  # deterministic
    (repo / "train.py").write_text("print('changed again')\n")
    second = code_id(repo)
    assert second.startswith(f"{sha}-d") and second != first
    (repo / "train.py").write_text("print('changed')\n")
    assert code_id(repo) == first  # depends on content only
    git(repo, "add", "train.py")
    assert code_id(repo) == first  # staged or not, the same diff against HEAD
    (repo / "train.py").write_text("print('hi')\n")
    git(repo, "add", "train.py")
    assert code_id(repo) == sha


def test_code_id_dirty_binary_file(repo: Path):
    sha = git(repo, "rev-parse", "HEAD")[:7]
    (repo / "data.bin").write_bytes(b"\x00\x01\x03")
    first = code_id(repo)
    (repo / "data.bin").write_bytes(b"\x00\x01\x04")
    assert first.startswith(f"{sha}-d") and code_id(repo).startswith(f"{sha}-d") and code_id(repo) != first


def test_code_id_ignores_untracked_files(repo: Path):
    (repo / "notes.txt").write_text("scratch\n")
    assert code_id(repo) == git(repo, "rev-parse", "HEAD")[:7]


def test_code_id_outside_repo_and_without_commits(tmp_path: Path):
    outside = tmp_path / "plain"
    outside.mkdir()
    assert code_id(outside) is None
    assert git_state(outside) is None
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")
    assert code_id(empty) is None
    assert code_id(tmp_path / "does-not-exist") is None


def test_code_id_default_is_script_dir_or_cwd(repo: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("sys.argv", [str(repo / "train.py")])
    monkeypatch.chdir(repo.parent)
    assert code_id() == git(repo, "rev-parse", "HEAD")[:7]
    monkeypatch.setattr("sys.argv", ["-c"])
    assert code_id() is None  # cwd is not in a repo
    monkeypatch.chdir(repo)
    assert code_id() == git(repo, "rev-parse", "HEAD")[:7]


def test_a_checkout_owned_by_another_user_keeps_its_code_id(repo: Path, tmp_path: Path):
    (repo / "train.py").write_text("print('dirty')\n")
    before, state = code_id(repo), git_state(repo)
    shutil.chown(repo, user=12345)  # git now refuses the checkout ("dubious ownership") to plain queries
    for path in repo.rglob("*"):
        os.chown(path, 12345, 12345, follow_symlinks=False)
    refused = subprocess.run(["git", "status"], cwd=repo, capture_output=True, text=True)
    assert refused.returncode != 0 and "dubious ownership" in refused.stderr
    assert code_id(repo) == before and code_id(repo / "train.py") == before
    assert git_state(repo) == state


def test_git_missing_from_path_stops_with_the_fix(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    for identify in (code_id, git_state):
        with pytest.raises(CodeIdentityError, match=r"no `git` program is on PATH .*no-git-here.*--workspace.code_id"):
            identify(repo)
    assert code_id(tmp_path / "plain") is None  # outside a checkout git is not needed


def test_a_broken_index_stops_with_gits_message(repo: Path):
    (repo / ".git" / "index").write_bytes(b"junk")
    with pytest.raises(CodeIdentityError, match=r"index file smaller than expected.*rm .git/index && git reset"):
        code_id(repo)


def test_git_state(repo: Path):
    sha = git(repo, "rev-parse", "HEAD")
    git(repo, "remote", "add", "origin", "https://example.com/r.git")
    state = git_state(repo)
    assert state["commit"] == sha and state["code_id"] == sha[:7] and state["dirty"] is False and state["diff"] == ""
    assert state["branch"] == git(repo, "rev-parse", "--abbrev-ref", "HEAD")
    assert state["remote"] == "https://example.com/r.git"
    (repo / "train.py").write_text("print('x')\n")
    state = git_state(repo)
    assert state["dirty"] is True and "print('x')" in state["diff"] and state["code_id"] == code_id(repo)
    git(repo, "checkout", "-q", "--detach")
    assert git_state(repo)["branch"] is None


def test_config_ids_of_runs_made_before_eval_and_compile_keys_existed_are_unchanged():
    """perdure 2e9e51a (before eval.*, compile.* and perf.* existed) gave examples/mlp.py's config these ids; a run
    it made must keep its directory after an upgrade (a requeued job, a pinned workspace.code_id)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mlp_example", Path(__file__).parent.parent / "examples" / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert config_id(module.Config().parse([], exit_on_error=False)) == "ff00af502d42"
    assert config_id(module.Config().parse(["--eval.interval", "20"], exit_on_error=False)) == "12d4ebd66a3a"
    assert config_id(module.Config().parse(["--compile.enabled"], exit_on_error=False)) == "ff00af502d42"
    with_steps = module.Config().parse(["--eval.steps", "5"], exit_on_error=False)
    assert config_id(with_steps) != "ff00af502d42" and canonical_config(with_steps)["eval"]["steps"] == 5
