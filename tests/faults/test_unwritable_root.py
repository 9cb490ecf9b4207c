"""A workspace root that cannot hold the run (a file in the way, a read-only disk, a disk out of inodes, no
permission): the run stops before writing anything with one line naming the directory, why, where the root came
from and the fix; never a traceback from deep inside the run lock."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from perdure.config import RunnerConfig
from perdure.errors import WorkspaceError
from perdure.workspace.run_dir import ROOT_ENV, resolve_run_dir
from tests.disks import mount_or_skip, unmount
from tests.runs import run

pytestmark = pytest.mark.timeout(120)


class UserConfig(RunnerConfig):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 10


def run_dir_under(*args: str):
    return resolve_run_dir(UserConfig().parse(list(args), exit_on_error=False), "MLPRunner")


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ROOT_ENV, raising=False)


def test_a_file_in_the_way_is_named_with_the_option_that_chose_the_root(tmp_path: Path):
    (tmp_path / "scratch").write_text("not a directory")
    run_dir = run_dir_under("--workspace.root", str(tmp_path / "scratch" / "runs"))
    with pytest.raises(WorkspaceError) as caught:
        run_dir.create_path()
    message = str(caught.value)
    assert f"cannot create the run directory {run_dir.path}" in message
    assert f"{tmp_path / 'scratch'} is a regular file, not a directory" in message
    assert "comes from --workspace.root" in message and f"move {tmp_path / 'scratch'} away" in message
    assert (tmp_path / "scratch").read_text() == "not a directory"


def test_the_root_from_the_environment_is_named_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "scratch").write_text("")
    monkeypatch.setenv(ROOT_ENV, str(tmp_path / "scratch"))
    with pytest.raises(WorkspaceError, match=r"comes from \$PERDURE_ROOT"):
        run_dir_under().create_path()
    config = UserConfig()
    config.workspace.root = str(tmp_path / "scratch")
    monkeypatch.delenv(ROOT_ENV)
    with pytest.raises(WorkspaceError, match="comes from workspace.root in the config"):
        resolve_run_dir(config.parse([], exit_on_error=False), "MLPRunner").create_path()


def test_a_read_only_disk(tmp_path: Path):
    disk = tmp_path / "ro"
    mount_or_skip(disk, "ro")
    try:
        with pytest.raises(WorkspaceError, match=r"ro cannot hold it \(Read-only file system\)"):
            run_dir_under("--workspace.root", str(disk / "runs")).create_path()
    finally:
        unmount(disk)


def test_a_disk_without_a_free_inode(tmp_path: Path):
    disk = tmp_path / "full"
    mount_or_skip(disk, "nr_inodes=2")
    try:
        os.mkdir(disk / "last")  # the root's inode and this one: the disk has no inode left for the run
        with pytest.raises(WorkspaceError, match=r"cannot hold it \(No space left on device\)"):
            run_dir_under("--workspace.root", str(disk / "runs")).create_path()
    finally:
        unmount(disk)


def test_a_directory_this_user_cannot_write():
    # Root writes into any directory: as root, the check runs in a forked child that has become `nobody`, under a
    # directory of /tmp that user may enter (pytest's own tmp_path is root's alone).
    top = Path(tempfile.mkdtemp(prefix="perdure-locked-"))
    try:
        top.chmod(0o755)
        locked = top / "locked"
        locked.mkdir(mode=0o555)
        run_dir = run_dir_under("--workspace.root", str(locked / "runs"))
        message = create_as_a_user(run_dir) if os.geteuid() == 0 else create(run_dir)
    finally:
        shutil.rmtree(top)
    assert f"{locked} is not writable by this user" in message, message
    assert f"give this user write access to {locked}, or point --workspace.root" in message


def create(run_dir) -> str:
    """What `create_path` raises, as text ("created" if it raised nothing)."""
    try:
        run_dir.create_path()
    except WorkspaceError as error:
        return str(error)
    return "created"


def create_as_a_user(run_dir, uid: int = 65534) -> str:
    """`create(run_dir)` in a forked child running as `uid` (nobody), the answer sent back through a pipe."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read_end)
            os.setgid(uid)
            os.setuid(uid)
            os.write(write_end, create(run_dir).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        message = answer.read().decode()
    assert os.waitpid(child, 0)[1] == 0, "the child could not become an unprivileged user"
    return message


def test_a_run_stops_with_one_line_and_writes_nothing(tmp_path: Path):
    (tmp_path / "scratch").write_text("")
    result = run("resumable.py", tmp_path / "scratch" / "runs", "--steps", "4")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert "cannot create the run directory" in line and "is a regular file, not a directory" in line
    assert sorted(path.name for path in tmp_path.iterdir()) == ["scratch"]
