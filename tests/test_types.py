"""The examples type-check under `mypy --strict` with the project's config (what `make lint` runs), and a type error in
one of them is caught: `Runner` is a concrete class to a type checker although the stack is chosen at run time."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

import pytest

api = pytest.importorskip("mypy.api", reason="mypy is in the dev extra: pip install -e '.[dev]'")

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_strict_flags_a_type_error_in_an_example_and_passes_the_real_one(tmp_path: Path) -> None:
    # One mypy run: the real example next to a copy with a deliberate error.
    real = tmp_path / "real" / "mlp.py"
    broken = tmp_path / "broken" / "mlp_broken.py"
    real.parent.mkdir()
    broken.parent.mkdir()
    shutil.copy(ROOT / "examples" / "mlp.py", real)
    source = real.read_text()
    assert "self.steps = 300" in source
    broken.write_text(source.replace("self.steps = 300", 'self.steps = "300"'))
    # A cold cache reads torch's stubs (~100 s of CPU). `make lint` checks the examples with --strict into a cache of
    # their own (`.mypy_cache/strict`, gitignored), which this test reuses: the default cache would not serve, since
    # lint's `mypy perdure` (default strictness) leaves torch's entries under other options. mypy rechecks any module
    # whose source, mypy or options changed, and both files checked here have a new path every run. Locked: two
    # sessions may share it.
    cache = ROOT / ".mypy_cache" / "strict"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stdout, stderr, status = api.run(
            [
                "--strict",
                "--config-file",
                str(ROOT / "pyproject.toml"),
                "--cache-dir",
                str(cache),
                str(real),
                str(broken),
            ]
        )
    errors = [line for line in stdout.splitlines() if ": error:" in line]
    assert status == 1, stdout + stderr
    assert errors, stdout
    assert all("mlp_broken.py" in line for line in errors), stdout
    assert any("[assignment]" in line for line in errors), stdout


def test_py_typed_ships_and_the_torch_requirement_is_the_tested_version() -> None:
    import torch
    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "perdure" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["perdure"]
    (torch_requirement,) = [r for r in map(Requirement, project["project"]["dependencies"]) if r.name == "torch"]
    assert torch_requirement.specifier.contains(torch.__version__.split("+")[0])
    assert not torch_requirement.specifier.contains("2.12.0") and not torch_requirement.specifier.contains("2.14.0")
