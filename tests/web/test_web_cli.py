"""The `perdure web` command itself: a missing extra, a missing root, a busy port, a non-loopback host."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

from tests import zygote
from tests.runs import REPO, environment
from tests.web.client import http_get


def perdure(*args: str, prelude: str = "", timeout: float = 60) -> subprocess.CompletedProcess:
    code = f"{prelude}\nimport sys\nfrom perdure.cli.main import main\nsys.exit(main({list(args)!r}))"
    return zygote.run(
        [sys.executable, "-c", code], env=environment(), cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_without_the_web_extra_it_says_which_extra_to_install(tmp_path):
    blocked = "import sys\nsys.modules['starlette'] = None\nsys.modules['uvicorn'] = None"
    result = perdure("web", "--root", str(tmp_path), prelude=blocked)
    assert result.returncode == 2
    assert "pip install 'perdure[web]'" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_root_is_a_clear_error(tmp_path):
    result = perdure("web", "--root", str(tmp_path / "nowhere"), "--port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"workspace root {tmp_path / 'nowhere'} does not exist; pass --root DIR" in result.stderr


def test_a_busy_port_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = perdure("web", "--root", str(tmp_path), "--port", str(port))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "pass another --port" in result.stderr


def test_a_non_loopback_host_warns_that_anyone_can_read_the_runs(tmp_path):
    command = [sys.executable, "-m", "perdure.cli.main", "web", "--root", str(tmp_path), "--host", "0.0.0.0"]
    command += ["--port", "0"]
    server = zygote.popen(
        command, env=environment(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        warning = server.stderr.readline()
        assert "anyone who can reach port" in warning and "can read every run" in warning
        for line in server.stdout:
            if match := re.search(r"serving on http://[^:]+:(\d+)/", line):
                break
        else:
            raise AssertionError("no URL printed")
        # Bound to every interface, the server answers on loopback too, whatever Host the client names.
        url = f"http://127.0.0.1:{match.group(1)}"
        assert http_get(url, "/api/runs", headers={"Host": "build-box.lan"})[0] == 200
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_web_is_a_perdure_subcommand():
    result = perdure("--help")
    assert result.returncode == 0 and "web" in result.stdout and "browse runs" in result.stdout
