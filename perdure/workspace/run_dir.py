"""Where a run lives: `<root>/<lineage>-<code_id>/<code_id>-<config_id>/`.

`code_id` is the identity of the code that runs (see `identity.program_code_id`), unless `workspace.code_id` pins it,
the launch index says this process is a restart of a launch that started in another directory (see `launch.py`), or
this launch finds no checkpoint under its own name and continues an unfinished run of the same lineage and config
that other code trained (see `siblings.py`). The code that actually ran is recorded by every attempt either way.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perdure.checkpoints.resolve import committed_checkpoints
from perdure.config import RunnerConfig, check_path_component
from perdure.errors import CodeIdentityError, WorkspaceError
from perdure.safe_io import UnsafeFileError, check_inside, ensure_dir, kind_of
from perdure.workspace.identity import config_id as compute_config_id
from perdure.workspace.identity import program_code_id
from perdure.workspace.launch import Launch, current_launch, entry_path, read_entry
from perdure.workspace.siblings import SiblingRun, sibling_runs, unfinished_sibling

DEFAULT_ROOT = "runs"
ROOT_ENV = "PERDURE_ROOT"

logger = logging.getLogger("perdure")


@dataclass(frozen=True)
class RunDir:
    """The directory of one run and the identities that named it."""

    path: Path
    lineage: str
    code_id: str | None  # the code part of the directory's name
    config_id: str
    run_id: str
    running_code_id: str | None = None  # the code this process runs (differs after a pinned or launch restart)
    launch: Launch | None = None
    continued_launch: bool = False  # found through the launch index (a restart of `launch`)
    unfinished: SiblingRun | None = None  # the unfinished run of other code this fresh launch continues
    root: Path | None = None
    workspace_id: str | None = None  # `workspace.id` when the config sets one
    root_origin: str = "the given root"  # where `root` came from: `--workspace.root`, `$PERDURE_ROOT`, ...

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def metadata(self) -> Path:
        return self.path / "metadata"

    def create(self) -> None:
        """Create the run's directories; a symlink where one belongs is refused (`UnsafeFileError`), never followed."""
        self.create_path()
        for directory in (self.checkpoints, self.logs, self.metadata):
            ensure_dir(directory)

    def create_path(self) -> None:
        """Create the run's own directory, and the workspace root and lineage folder above it where missing.

        A failure there (a file where a directory belongs, no permission, a read-only or full disk) is the
        workspace's place, not the run: it becomes a `WorkspaceError` saying which directory stopped it, why, where
        the root came from and how to choose another. A symlink is refused as `ensure_dir` refuses it.
        """
        try:
            ensure_dir(self.path)
        except UnsafeFileError:
            raise
        except OSError as error:
            raise WorkspaceError(self._cannot_create(error)) from None

    def _cannot_create(self, error: OSError) -> str:
        blocker, reason, fix = _what_blocks(self.path, error)
        root = self.root if self.root is not None else self.path.parent.parent
        return (
            f"cannot create the run directory {self.path}: {blocker} {reason}. The workspace root {root} comes from "
            f"{self.root_origin}: {fix}point --workspace.root (or ${ROOT_ENV}) at a directory this user can write"
        )


def _what_blocks(path: Path, error: OSError) -> tuple[Path, str, str]:
    """Why `path` cannot be made: the nearest existing path above it, what is wrong there, and a fix besides choosing
    another root (ending in "or ", or empty)."""
    existing = path
    while not os.path.lexists(existing) and existing.parent != existing:
        existing = existing.parent
    try:
        mode = os.lstat(existing).st_mode
    except OSError:
        return existing, f"cannot be read ({error.strerror or error})", ""
    if not stat.S_ISDIR(mode):
        return existing, f"is {kind_of(mode)}, not a directory", f"move {existing} away, or "
    if error.errno in (errno.EACCES, errno.EPERM):
        return existing, "is not writable by this user", f"give this user write access to {existing}, or "
    return existing, f"cannot hold it ({error.strerror or error})", ""


def workspace_root(config: Mapping[str, Any] | str | os.PathLike | None = None) -> Path:
    """The workspace root, the first of: `--workspace.root` on the command line, `$PERDURE_ROOT`, `workspace.root`
    from a `--config` file or set in code, `./runs`.

    `config` is a `RunnerConfig` (a mapping: its `command_line_keys()` tell where `workspace.root` came from), or an
    explicit root (a str / path, returned as is), or None (`$PERDURE_ROOT`, else `./runs`).
    """
    return _root_and_origin(config)[0]


def _root_and_origin(config: Mapping[str, Any] | str | os.PathLike | None) -> tuple[Path, str]:
    """`workspace_root(config)` and where it came from, as the user would change it (for messages)."""
    if isinstance(config, (str, os.PathLike)):
        return Path(config).expanduser(), "the given root"
    configured = _configured_root(config)
    from_cli = isinstance(config, RunnerConfig) and config.from_command_line("workspace.root")
    if configured and from_cli:
        return Path(configured).expanduser(), "--workspace.root"
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV]).expanduser(), f"${ROOT_ENV}"
    if configured:
        return Path(configured).expanduser(), "workspace.root in the config"
    return Path(DEFAULT_ROOT), f"the default (./{DEFAULT_ROOT}: no --workspace.root, no ${ROOT_ENV})"


def _configured_root(config: Mapping[str, Any] | None) -> str | os.PathLike | None:
    """`workspace.root` of `config` without creating a missing section (chanfig creates one on attribute access)."""
    if config is None:
        return None
    if isinstance(config, RunnerConfig):
        return config.lookup("workspace.root")
    workspace = config.get("workspace")
    return workspace.get("root") if isinstance(workspace, Mapping) else None


def default_lineage(runner_class_name: str) -> str:
    """`MLPRunner` -> `mlp`, `ImageNetTrainer` -> `image_net_trainer`: a readable default lineage."""
    name = re.sub(r"Runner$", "", runner_class_name) or runner_class_name
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def resolve_run_dir(config, runner_class_name: str) -> RunDir:
    """Name the run directory from the config's identity and the code's. Creates nothing.

    A restart of a launch (see `launch.current_launch`) continues the directory the launch's first attempt recorded
    in the launch index, whatever the code is now; otherwise `workspace.code_id`, when set, stands for the code.
    Otherwise a launch that finds no checkpoint under its own code's name continues the unfinished run of the same
    lineage and config that other code trained (`workspace.continue_unfinished`, default true).
    """
    workspace = config.get("workspace") or {}
    for key in ("lineage", "id", "code_id"):  # a stored config (from_checkpoint) reaches here before check()
        check_path_component(f"workspace.{key}", workspace.get(key))
    root, root_origin = _root_and_origin(config)
    lineage = workspace.get("lineage") or default_lineage(runner_class_name)
    running = _running_code_id(pinned=workspace.get("code_id"))
    code = workspace.get("code_id") or running
    cfg = compute_config_id(config)
    workspace_id = workspace.get("id")
    run_id = workspace_id or f"{code}-{cfg}"
    path = root / f"{lineage}-{code}" / run_id
    launch = current_launch()
    continued = False
    if launch is not None and launch.is_restart:
        index = entry_path(root, launch, lineage=lineage, config_id=cfg, workspace_id=workspace_id)
        entry = read_entry(index, root)
        if entry is not None:
            path, code, run_id, continued = root / entry["run_dir"], entry["code_id"], entry["run_id"], True
    unfinished = None
    if not continued and not workspace.get("code_id") and workspace.get("continue_unfinished", True):
        unfinished = _unfinished_run_of_other_code(path, root, lineage, cfg, workspace_id, running, config)
        if unfinished is not None:
            path, code, run_id = unfinished.path, unfinished.path.parent.name[len(lineage) + 1 :], unfinished.path.name
    return RunDir(
        path=check_under_root(path, root),
        lineage=lineage,
        code_id=code,
        config_id=cfg,
        run_id=run_id,
        running_code_id=running,
        launch=launch,
        continued_launch=continued,
        unfinished=unfinished,
        root=root,
        workspace_id=workspace_id,
        root_origin=root_origin,
    )


def _unfinished_run_of_other_code(
    path: Path, root: Path, lineage: str, config_id: str, workspace_id: str | None, running: str | None, config
) -> SiblingRun | None:
    """A fresh launch whose own directory (`path`) has no checkpoint continues the unfinished run of the same lineage
    and config that other code trained (see `siblings.unfinished_sibling`); None when there is none to continue.
    A run that `--checkpoint` / `--pretrained` start from is not continued: the command branches a new run from it."""
    if committed_checkpoints(path / "checkpoints"):
        return None
    siblings = sibling_runs(root, lineage=lineage, config_id=config_id, workspace_id=workspace_id, exclude=path)
    sources = [Path(source).absolute() for source in (config.get("checkpoint"), config.get("pretrained")) if source]
    siblings = [s for s in siblings if not any(source.is_relative_to(s.path.absolute()) for source in sources)]
    return unfinished_sibling(siblings, lineage=lineage, running_code_id=running)


def _running_code_id(pinned: str | None) -> str | None:
    """The code identity of this process. A checkout git cannot read stops the launch (`CodeIdentityError`), unless
    `workspace.code_id` names the run: then the attempt records its code as unknown, with a warning."""
    try:
        return program_code_id()
    except CodeIdentityError as error:
        if not pinned:
            raise
        logger.warning("%s. The run is named by --workspace.code_id %s; this attempt's code is recorded as unknown",
                       error, pinned)  # fmt: skip
        return None


def check_under_root(path: Path, root: Path) -> Path:
    """`path` (a run directory) if it is two single-name levels under `root` and, with symlinks resolved, inside it;
    else `UnsafeFileError` saying where it would have gone. Everything a workspace writes stays under its root."""
    relative = path.relative_to(root) if path.is_relative_to(root) else None
    if relative is None or len(relative.parts) != 2 or any(part in ("", ".", "..") for part in relative.parts):
        raise UnsafeFileError(path, f"is not a run directory under the workspace root {root}")
    return check_inside(path, root, what="a run directory, through a symlink")
