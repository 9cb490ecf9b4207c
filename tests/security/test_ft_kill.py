"""Issue 32, item 3: a replica group stopped from the lighthouse's dashboard (`POST /replica/<id>/kill`, which makes
torchft's manager server call C `exit(1)`) says so in one line, records its attempt `killed` and exits 94 — not 1
with a raw `RuntimeError: unknown parameter type` traceback.

The real `perdure ft lighthouse`, a real group, the kill over real HTTP.
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from perdure.ft.kill_watch import KILLED_EXIT_CODE
from tests.ft.conftest import LIGHTHOUSE_ARGS, start_lighthouse, stop_lighthouse
from tests.ft.groups import launch, sidecar, wait_until

pytest.importorskip("torchft", reason="the ft extra is not installed (pip install 'perdure[ft]')")
pytestmark = pytest.mark.timeout(120)


def test_a_group_killed_from_the_dashboard_says_so_and_records_it(tmp_path):
    server, address = start_lighthouse(*LIGHTHOUSE_ARGS)
    root = tmp_path / "runs"
    group = launch(root, address, 0, "--steps", "2000", "--ft.group_size", "1", STEP_SLEEP="0.05")
    try:
        log = group.logs[0]
        wait_until(lambda: log.exists() and "quorum of 1 group(s)" in log.read_text(errors="replace"),
                   "the group's first quorum", [group])  # fmt: skip
        time.sleep(0.5)
        page = urllib.request.urlopen(f"{address}/status", timeout=20).read().decode()
        (replica,) = set(re.findall(r"perdure_00000:[0-9a-f-]{36}", page))
        kill = urllib.request.Request(f"{address}/replica/{replica}/kill", method="POST")
        try:
            urllib.request.urlopen(kill, timeout=20)
        except urllib.error.HTTPError as error:  # the process ends while torchft's lighthouse waits for its answer
            assert b"transport error" in error.read(), error
        codes = group.wait(60)
    finally:
        group.kill()
        stop_lighthouse(server)
    output = group.output()
    assert codes == [KILLED_EXIT_CODE], output[-3000:]
    assert "got kill request: killed from dashboard" in output  # torchft's own line: it was that kill
    assert "replica group 0 was stopped from outside: its torchft manager received a kill request" in output
    assert f"the lighthouse at {address}" in output and f"exit status {KILLED_EXIT_CODE}" in output
    assert "Traceback" not in output, output[-3000:]
    attempt = sidecar(root)["attempts"][-1]
    assert attempt["status"] == "killed" and "stopped from outside" in attempt["exit_reason"], attempt
