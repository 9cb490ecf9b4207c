"""Issue 16, items 6 and 7: a hostile JSON or YAML file, a FIFO, never blocks a run, the registry or a command."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from perdure.checkpoints.commit import read_pointer
from tests import zygote
from tests.runs import SCRIPTS, environment
from tests.scripts.resumable import ResumableRunner, make_config
from tests.security.hostile import TINY, latest, perdure_cli_each, resume, run_dir_of, text

pytestmark = pytest.mark.timeout(120)
DEEP = "[" * 100_000 + "]" * 100_000


def resume_in_process(root: Path, **settings) -> ResumableRunner:
    runner = ResumableRunner(make_config(root, **{**TINY, "steps": 6, **settings}))
    runner.train()
    return runner


def second_run(root: Path) -> Path:
    """A second, healthy run beside the victim (a copy under another id)."""
    victim = run_dir_of(root)
    other = victim.with_name("healthy")
    shutil.copytree(victim, other, symlinks=True)
    sidecar = json.loads((other / "sidecar.json").read_text())
    (other / "sidecar.json").write_text(json.dumps({**sidecar, "run_id": "healthy"}))
    return other


# ---- item 6: one hostile JSON file blocks neither its run nor the registry ------------------------------------------


def deep_sidecar(sidecar: dict) -> str:
    return json.dumps({**sidecar, "hparams": "HOLE"}).replace('"HOLE"', DEEP)


def wrong_types(sidecar: dict) -> str:
    return json.dumps({**sidecar, "attempts": [1, "two"], "summary": {"train/loss": 5}, "step": "many"})


@pytest.mark.parametrize("hostile", [deep_sidecar, wrong_types], ids=["nested-100000", "wrong-types"])
def test_a_hostile_sidecar_blocks_neither_the_registry_nor_the_run(file_root, hostile):
    run = run_dir_of(file_root)
    second_run(file_root)
    (run / "sidecar.json").write_text(hostile(json.loads((run / "sidecar.json").read_text())))

    codes, output = perdure_cli_each(
        ("runs", "ls", "--root", file_root), ("runs", "export", file_root / "runs.csv", "--root", file_root)
    )
    assert codes == [0, 0], output
    assert b"healthy" in output and b"warning: skipped" in output and b"wrote 1 run(s)" in output

    runner = resume_in_process(file_root)  # the run itself restarts: its sidecar is moved aside, history starts anew
    assert runner.global_step == 6
    assert list(run.glob("sidecar.json.corrupt-*"))
    assert json.loads((run / "sidecar.json").read_text())["step"] == 6


def deep_manifest(manifest: dict) -> str:
    return json.dumps({**manifest, "score": "HOLE"}).replace('"HOLE"', DEEP)


def wrong_step(manifest: dict) -> str:
    return json.dumps({**manifest, "global_step": "4", "files": manifest["files"]})


@pytest.mark.parametrize("hostile", [deep_manifest, wrong_step], ids=["nested-100000", "wrong-types"])
def test_a_hostile_manifest_quarantines_its_checkpoint_and_the_run_resumes_from_an_older_one(file_root, hostile):
    run = run_dir_of(file_root)
    manifest = run / "checkpoints" / "ckpt-s000000000004" / "manifest.json"
    manifest.write_text(hostile(json.loads(manifest.read_text())))
    runner = resume_in_process(file_root)
    assert runner.restore_source.info.name == "ckpt-s000000000002" and runner.global_step == 6
    assert [p.name for p in (run / "checkpoints" / "quarantine").iterdir() if p.name.startswith("ckpt-s000000000004")]


# ---- item 7: resources and hangs -------------------------------------------------------------------------------------

LAUGHS = """a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
steps: 4
"""

# Runs the training script and reports its peak memory on stderr, however it exits.
MEASURED = (
    "import atexit, resource, runpy, sys; "
    "start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
    "atexit.register(lambda: sys.stderr.write("
    "f'MAXRSS_KB {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} START_KB {start}\\n')); "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_a_yaml_alias_bomb_fails_within_seconds_and_bounded_memory(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(LAUGHS)
    script = str(SCRIPTS / "resumable.py")
    command = [sys.executable, "-c", MEASURED, script, "--config", str(bomb), "--workspace.root", str(tmp_path / "r")]
    started = time.monotonic()
    result = zygote.run(command, env=environment(), capture_output=True, timeout=60)
    seconds = time.monotonic() - started
    peak_mb = int(text(result).split("MAXRSS_KB ")[1].split()[0]) / 1024
    # a program forked from the test zygote starts with the zygote's pages (torch, DeepSpeed): count what it adds
    start_mb = int(text(result).split("START_KB ")[1].split()[0]) / 1024
    assert result.returncode == 2
    assert "error: config key 'config'" in text(result) and "alias" in text(result) and "Traceback" not in text(result)
    assert seconds < 20, seconds  # the import of torch is most of it
    assert peak_mb - start_mb < 512, (peak_mb, start_mb)  # parsing and the refusal: the bomb itself adds nothing
    assert not (tmp_path / "r").exists()


def test_a_fifo_manifest_does_not_hang_ckpt_verify_or_ls(file_root):
    checkpoint = latest(run_dir_of(file_root))
    (checkpoint / "manifest.json").unlink()
    os.mkfifo(checkpoint / "manifest.json")
    codes, output = perdure_cli_each(("ckpt", "verify", checkpoint), ("ckpt", "ls", run_dir_of(file_root)))
    assert codes == [1, 0]  # both returned; verify says what failed, ls lists the checkpoint as failed
    assert output.count(b"manifest.json is a FIFO, not a regular file") == 2


def test_a_fifo_latest_pointer_does_not_hang_the_resume(file_root):
    checkpoints = run_dir_of(file_root) / "checkpoints"
    (checkpoints / "latest").unlink()
    os.mkfifo(checkpoints / "latest")
    result = resume(file_root, timeout=90)
    assert result.returncode == 0, text(result)
    assert "resuming from" in text(result) and "ckpt-s000000000004" in text(result)
    assert read_pointer(checkpoints, "latest") == "ckpt-s000000000006"
