"""The run registry as a Python API: the same queries as `perdure runs ...`.

    from perdure import registry

    reg = registry.Registry("runs")                 # or Registry() for $PERDURE_ROOT, else ./runs
    for run in reg.runs(lineage="mlp", status="completed"):
        print(run.run_id, run.metric("val/loss", "min"))
    top = reg.best("val/accuracy", maximize=True, limit=5)
    reg.get("3f2a")                                 # a unique prefix of an id is enough
    reg.export("runs.csv")

The module-level functions are shortcuts that open a `Registry` on `root` for one query.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from perdure.workspace.registry import (
    REGISTRY_NAME,
    AmbiguousRunError,
    Registry,
    RegistryError,
    RunNotFoundError,
    RunRecord,
    ScanIssue,
    ScanReport,
)
from perdure.workspace.sidecar import STATUSES, SidecarError, read_sidecar

__all__ = [
    "REGISTRY_NAME",
    "STATUSES",
    "AmbiguousRunError",
    "Registry",
    "RegistryError",
    "RunNotFoundError",
    "RunRecord",
    "ScanIssue",
    "ScanReport",
    "SidecarError",
    "best",
    "export",
    "get",
    "read_sidecar",
    "runs",
    "scan",
]


def scan(root: Path | str | None = None, *, full: bool = False) -> ScanReport:
    """`Registry(root).scan(full=full)`."""
    with Registry(root) as registry:
        return registry.scan(full=full)


def runs(root: Path | str | None = None, **filters: Any) -> list[RunRecord]:
    """`Registry(root).runs(lineage=..., status=..., tag=...)`."""
    with Registry(root) as registry:
        return registry.runs(**filters)


def get(id_or_prefix: str, root: Path | str | None = None) -> RunRecord:
    """`Registry(root).get(id_or_prefix)`."""
    with Registry(root) as registry:
        return registry.get(id_or_prefix)


def best(metric: str, root: Path | str | None = None, **options: Any) -> list[tuple[RunRecord, float]]:
    """`Registry(root).best(metric, maximize=..., lineage=..., status=..., tag=..., limit=...)`."""
    with Registry(root) as registry:
        return registry.best(metric, **options)


def export(path: Path | str, root: Path | str | None = None, **filters: Any) -> Path:
    """`Registry(root).export(path, lineage=..., status=..., tag=...)`."""
    with Registry(root) as registry:
        return registry.export(Path(path), **filters)
