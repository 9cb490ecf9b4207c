"""Where a run lives: `<root>/<lineage>-<code_id>/<code_id>-<config_id>/`."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from perdure.workspace.identity import code_id as current_code_id
from perdure.workspace.identity import config_id as compute_config_id

DEFAULT_ROOT = "runs"
ROOT_ENV = "PERDURE_ROOT"


@dataclass(frozen=True)
class RunDir:
    """The directory of one run and the identities that named it."""

    path: Path
    lineage: str
    code_id: str | None
    config_id: str
    run_id: str

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
        for directory in (self.path, self.checkpoints, self.logs, self.metadata):
            directory.mkdir(parents=True, exist_ok=True)


def workspace_root(configured: str | os.PathLike | None) -> Path:
    """`workspace.root` if set, else `$PERDURE_ROOT`, else `./runs`."""
    if configured:
        return Path(configured)
    if os.environ.get(ROOT_ENV):
        return Path(os.environ[ROOT_ENV])
    return Path(DEFAULT_ROOT)


def default_lineage(runner_class_name: str) -> str:
    """`MLPRunner` -> `mlp`, `ImageNetTrainer` -> `image_net_trainer`: a readable default lineage."""
    name = re.sub(r"Runner$", "", runner_class_name) or runner_class_name
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def resolve_run_dir(config, runner_class_name: str) -> RunDir:
    """Name the run directory from the config's identity and the code's. Creates nothing."""
    workspace = config.get("workspace") or {}
    root = workspace_root(workspace.get("root"))
    lineage = workspace.get("lineage") or default_lineage(runner_class_name)
    code = current_code_id()
    cfg = compute_config_id(config)
    run_id = workspace.get("id") or (f"{code}-{cfg}" if code else cfg)
    group = f"{lineage}-{code}" if code else lineage
    return RunDir(path=root / group / run_id, lineage=lineage, code_id=code, config_id=cfg, run_id=run_id)
