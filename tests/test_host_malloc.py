"""The runner holds glibc's malloc thresholds at their ceilings (perdure/runners/host_malloc.py), unless the user set
them: seen from the heap itself, in a fresh process each (the thresholds are process-wide)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import REPO, environment

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"),
    reason="the thresholds under test are glibc's malloc's: this machine's C library is not glibc",
)

# Prints whether an 8 MiB block lies in the heap (below its end, sbrk(0)) and how far freeing it moves the heap's end,
# after the statements in HOLD (which set `held`). With glibc's defaults, in a process that freed no such block yet,
# it is a mapping of its own, unmapped when freed; held, it comes from the heap, and freeing it leaves the heap as it
# was. (Probing before HOLD would not do: freeing a mapped block raises glibc's dynamic thresholds to its size.)
PROBE = """
import ctypes, json
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
HOLD
block = libc.malloc(8 << 20)
end = libc.sbrk(0)
libc.free(block)
print(json.dumps({"held": held, "in_heap": block < end, "shrunk_by": end - libc.sbrk(0)}))
"""
# The module alone, loaded from its file (no torch import): the function under test, in a fresh interpreter.
MODULE = """
import importlib.util
spec = importlib.util.spec_from_file_location("host_malloc", "perdure/runners/host_malloc.py")
host_malloc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(host_malloc)
"""
HOLD = "held = host_malloc.hold_malloc_thresholds()"
MAPPED = {"in_heap": False, "shrunk_by": 0}  # glibc's defaults (or the user's): a mapping of its own
KEPT = {"in_heap": True, "shrunk_by": 0}  # held: from the heap, which freeing it does not shrink


def probe(prelude: str, hold: str, **env: str) -> dict[str, object]:
    code = prelude + PROBE.replace("HOLD", hold)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=environment(**env), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    return {key: seen[key] for key in ("in_heap", "shrunk_by")} | {"held": seen["held"]}


@pytest.mark.timeout(60)
def test_a_large_block_comes_from_the_heap_and_stays_there_once_held():
    assert probe(MODULE, "held = False") == {**MAPPED, "held": False}
    assert probe(MODULE, HOLD) == {**KEPT, "held": True}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "variable",
    [
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"MALLOC_TRIM_THRESHOLD_": "131072"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=131072"},
    ],  # fmt: skip
    ids=["mmap", "trim", "tunables"],
)
def test_the_users_malloc_settings_are_left_alone(variable):
    assert probe(MODULE, HOLD, **variable) == {**MAPPED, "held": False}


# A runner built in the probe (torch and perdure imported either way): its __init__ holds them.
RUNNER = """
import torch
from perdure import Runner, RunnerConfig
class Tiny(Runner):
    def __init__(self, config):
        super().__init__(config)
        self.model = torch.nn.Linear(2, 2)
        self.criterion = torch.nn.MSELoss()
        self.datasets["train"] = torch.utils.data.TensorDataset(torch.zeros(4, 2), torch.zeros(4, 2))
"""
BUILD = """
config = RunnerConfig()
config.steps, config.ckpt.enabled, config.workspace.root = 1, False, ROOT
Tiny(config)
held = None
"""


@pytest.mark.timeout(120)
def test_a_runner_holds_them_from_its_start_unless_the_user_set_them(tmp_path: Path):
    build = BUILD.replace("ROOT", repr(str(tmp_path)))
    assert probe(RUNNER, "held = None", PERDURE_ROOT=str(tmp_path)) == {**MAPPED, "held": None}  # imports alone
    assert probe(RUNNER, build, PERDURE_ROOT=str(tmp_path)) == {**KEPT, "held": None}
    user = {"MALLOC_MMAP_THRESHOLD_": "131072", "PERDURE_ROOT": str(tmp_path)}
    assert probe(RUNNER, build, **user) == {**MAPPED, "held": None}
