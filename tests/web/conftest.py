"""One workspace for every web test, made by real training runs, and a real `perdure web` server on it.

Built once per session (about 20 s of training on 2 cores):
  baseline   resumable.py, 30 steps, completed; tags "sweep" and a hostile HTML tag
  wide       resumable.py, another width and learning rate, completed (the second curve of the comparison)
  images     web_images.py, logs two image tags every 5 steps, completed
  crash      web_images.py raising at step 12: failed
  killed     resumable.py SIGKILLed by itself at step 12: its sidecar still says running, its heartbeat ages: stale
  live       resumable.py still training (a live process, stopped when the session ends): running

Planted afterwards, as an attacker with write access to a run directory would: a symlink in a run's media/ and logs/
pointing at a file outside the root, and media.jsonl lines whose paths leave the run.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import zygote
from tests.runs import REPO, SCRIPTS, assert_ok, environment, run
from tests.web.client import HOSTILE_TAG, SECRET

STALE_AFTER = 6.0
COMMON = ("--log.interval", "2", "--ckpt.interval", "10")


@dataclass
class WebWorkspace:
    root: Path
    secret: Path  # a file outside the root that no route may serve
    url: str
    ids: dict[str, str]  # lineage -> run id as the API lists it
    live: subprocess.Popen


def _run_dirs(root: Path, lineage: str) -> list[Path]:
    return [path.parent for path in root.glob(f"{lineage}-*/*/sidecar.json")]


def _wait(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _sidecar_status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / "sidecar.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


def _start_live(root: Path) -> subprocess.Popen:
    command = [sys.executable, str(SCRIPTS / "resumable.py"), "--workspace.root", str(root)]
    command += ["--steps", "100000", "--workspace.lineage", "live", *COMMON, "--ckpt.keep_latest_k", "2"]
    # A point every ~0.8 s: the curves the tests watch grow within seconds, and the run trains through the whole
    # session of its pytest worker (at 0.1 s a step it cost ~140 CPU s of a full `make test`, tests/cpu_report.py).
    env = environment(STEP_SLEEP="0.4")
    return zygote.popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _start_server(root: Path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "perdure.cli.main", "web", "--root", str(root), "--port", "0"]
    command += ["--stale-after", str(STALE_AFTER)]
    server = zygote.popen(
        command, env=environment(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in server.stdout:
        lines.append(line)
        if match := re.search(r"serving on (http://\S+)", line):
            return server, match.group(1).rstrip("/")
    raise AssertionError("perdure web did not start:\n" + "".join(lines))


def _stop(process: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def web_workspace(tmp_path_factory) -> WebWorkspace:
    base = tmp_path_factory.mktemp("web")
    root = base / "runs"
    secret = base / "secret.txt"
    secret.write_text(SECRET + "\n")

    def train(script: str, lineage: str, *args: str, **env: str):
        return run(script, root, "--steps", "30", "--workspace.lineage", lineage, *COMMON, *args, **env)

    # The killed run first, so that its heartbeat is old enough to read as stale by the time the tests look.
    killed = train("resumable.py", "killed", KILL_AT_STEP="12")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    live = _start_live(root)
    try:
        assert_ok(train("resumable.py", "baseline", "--workspace.tags", f"{HOSTILE_TAG},sweep"))
        assert_ok(train("resumable.py", "wide", "--width", "64", "--optim.lr", "0.003", "--workspace.tags", "sweep"))
        assert_ok(train("web_images.py", "images", "--seed", "3", IMAGE_EVERY="5"))
        crash = train("web_images.py", "crash", "--seed", "5", FAIL_AT_STEP="12")
        assert crash.returncode != 0 and "deliberate failure" in crash.stderr + crash.stdout

        (live_dir,) = _wait_for_one(root, "live")
        _wait(lambda: _sidecar_status(live_dir) == "running" and (live_dir / "metrics.csv").exists(), "the live run")
        (killed_dir,) = _run_dirs(root, "killed")
        _wait(lambda: time.time() - (killed_dir / "heartbeat").stat().st_mtime > STALE_AFTER + 0.5, "a stale heartbeat")

        (images_dir,) = _run_dirs(root, "images")
        (images_dir / "media" / "leak.png").symlink_to(secret)
        (images_dir / "logs" / "leak.log").symlink_to(secret)
        with (images_dir / "media.jsonl").open("a") as index:
            for path in ("../../../secret.txt", "media/../../../secret.txt", str(secret), "media/leak.png"):
                index.write(json.dumps({"step": 99, "tag": "attack", "index": 0, "path": path}) + "\n")

        server, url = _start_server(root)
        try:
            with urllib.request.urlopen(f"{url}/api/runs", timeout=30) as response:
                listed = json.load(response)["runs"]
            ids = {row["lineage"]: row["id"] for row in listed}
            yield WebWorkspace(root=root, secret=secret, url=url, ids=ids, live=live)
        finally:
            _stop(server)
    finally:
        _stop(live)


def _wait_for_one(root: Path, lineage: str) -> list[Path]:
    _wait(lambda: len(_run_dirs(root, lineage)) == 1, f"the {lineage} run's sidecar")
    return _run_dirs(root, lineage)
