"""`perdure web`'s JSON API and pages, over HTTP, on a workspace made by real training runs (see conftest.py)."""

from __future__ import annotations

import csv
import json
import re
import time
from pathlib import Path
from urllib.parse import quote

from tests.web.client import HOSTILE_TAG, api, http_get

EXPECTED_STATUS = {
    "baseline": "completed",
    "wide": "completed",
    "images": "completed",
    "crash": "failed",
    "killed": "stale",
    "live": "running",
}


def path_of(workspace, lineage: str) -> str:
    return "/".join(quote(part, safe="") for part in workspace.ids[lineage].split("/"))


def test_runs_lists_every_run_with_its_columns(web_workspace):
    rows = {row["lineage"]: row for row in api(web_workspace.url, "/api/runs")["runs"]}
    assert {lineage: row["status"] for lineage, row in rows.items()} == EXPECTED_STATUS

    baseline = rows["baseline"]
    sidecar = json.loads((web_workspace.root / baseline["id"] / "sidecar.json").read_text())
    assert baseline["id"] == f"{baseline['lineage']}-{sidecar['code_id']}/{sidecar['run_id']}"
    assert baseline["url"] == "/runs/" + baseline["id"]
    assert (baseline["step"], baseline["budget"], baseline["budget_unit"], baseline["attempts"]) == (30, 30, "steps", 1)
    assert baseline["metric"] == "val/loss" and baseline["metric_mode"] == "min"
    assert baseline["metric_latest"] == sidecar["summary"]["val/loss"]["latest"]
    assert baseline["metric_best"] == sidecar["summary"]["val/loss"]["min"]
    assert baseline["checkpoint"] == "ckpt-s000000000030" and baseline["checkpoint_verified"] is True
    assert baseline["tags"] == [HOSTILE_TAG, "sweep"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z", baseline["started"])
    assert baseline["updated"] >= baseline["started"]

    assert rows["crash"]["checkpoint"] == "ckpt-s000000000010" and rows["crash"]["step"] == 12
    assert rows["killed"]["checkpoint"] == "ckpt-s000000000010"
    assert rows["live"]["budget"] == 100000


def test_run_page_data(web_workspace):
    run = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'baseline')}")
    assert run["config"]["full"]["steps"] == 30
    assert run["config"]["diff"]["changed"]["steps"] == {"default": None, "value": 30}
    assert set(run["config"]["git"]) >= {"commit", "code_id", "branch", "dirty"}
    (attempt,) = run["attempt_list"]
    assert (attempt["status"], attempt["exit_reason"], attempt["steps_lost"]) == ("completed", "budget reached", 0)
    goodput = run["goodput"]  # one attempt: the run's parts are the attempt's, no queue
    assert list(goodput["seconds"])[:3] == ["startup", "restore", "compile"] and goodput["seconds"]["queue"] == 0
    assert goodput["seconds"]["kept_training"] == attempt["goodput"]["seconds"]["kept_training"] > 0
    assert 0 < goodput["fraction"] == attempt["goodput"]["fraction"] < 1
    deadline = time.monotonic() + 60  # sizes at once, checksums once the background verification is through
    while not all(c["checked"] == "checksums" for c in run["checkpoints"]["checkpoints"]):
        assert all(c["verified"] for c in run["checkpoints"]["checkpoints"]) and time.monotonic() < deadline
        time.sleep(0.1)
        run = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'baseline')}")
    checkpoints = run["checkpoints"]["checkpoints"]
    assert [c["name"] for c in checkpoints] == [f"ckpt-s{step:012d}" for step in (30, 20, 10)]
    assert all(c["verified"] and c["checked"] == "checksums" for c in checkpoints)
    assert checkpoints[0]["latest"] and checkpoints[0]["step"] == 30 and checkpoints[0]["reason"]
    assert checkpoints[0]["size"] > 0 and checkpoints[0]["files"] >= 2
    assert [log["name"] for log in run["logs"]] == [f"{attempt['started'].replace('-', '').replace(':', '')}.log"]

    crash = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'crash')}")
    assert crash["attempt_list"][0]["status"] == "failed"
    assert "deliberate failure at step 12" in crash["attempt_list"][0]["exit_reason"]
    log = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'crash')}/log")
    assert "step 12/30 train" in log["text"] and log["truncated"] is False


def test_log_is_tailed(web_workspace):
    tail = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'baseline')}/log?kib=1")
    assert tail["truncated"] and tail["size"] > 1024
    assert 0 < len(tail["text"].encode()) <= 1024
    (log_file,) = (web_workspace.root / web_workspace.ids["baseline"] / "logs").iterdir()
    assert log_file.read_text().endswith(tail["text"])


def test_metrics_are_metrics_csv(web_workspace):
    data = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'baseline')}/metrics")
    expected: dict[str, list[tuple[int, float]]] = {}
    with (web_workspace.root / web_workspace.ids["baseline"] / "metrics.csv").open() as stream:
        for row in csv.DictReader(stream):
            expected.setdefault(f"{row['split']}/{row['name']}", []).append((int(row["step"]), float(row["value"])))
    assert set(data["metrics"]) == set(expected) >= {"train/loss", "train/lr", "train/steps_per_s", "val/loss"}
    for key, points in expected.items():
        assert list(zip(data["metrics"][key]["step"], data["metrics"][key]["value"])) == points
    assert data["metrics"]["train/loss"]["step"] == list(range(2, 31, 2))
    times = data["metrics"]["train/loss"]["time"]
    assert data["time_source"] == "train/steps_per_s" and all(b > a > 0 for a, b in zip(times, times[1:]))

    few = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'baseline')}/metrics?max_points=4")
    assert few["metrics"]["train/loss"]["step"] == [2, 12, 20, 30]


def test_running_run_curves_grow(web_workspace):
    url = f"/api/runs/{path_of(web_workspace, 'live')}/metrics"
    before = len(api(web_workspace.url, url)["metrics"]["train/loss"]["step"])
    deadline = time.monotonic() + 30
    while len(api(web_workspace.url, url)["metrics"]["train/loss"]["step"]) <= before:
        assert time.monotonic() < deadline, "the live run's curve did not grow"
        time.sleep(0.2)
    assert web_workspace.live.poll() is None


def test_media_lists_and_serves_images(web_workspace):
    run_dir = web_workspace.root / web_workspace.ids["images"]
    media = api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'images')}/media")["media"]
    tags = {item["tag"] for item in media}
    assert tags == {"samples/pattern", "weights/layer0"}  # the planted "attack" lines are not listed
    steps = sorted(item["step"] for item in media if item["tag"] == "samples/pattern")
    assert steps == [0, 5, 10, 15, 20, 25]
    index = {
        (r["tag"], r["step"]): r["path"] for r in map(json.loads, (run_dir / "media.jsonl").read_text().splitlines())
    }
    for item in media:
        status, headers, body = http_get(web_workspace.url, item["url"])
        assert status == 200 and headers["content-type"] == "image/png"
        assert body == (run_dir / index[(item["tag"], item["step"])]).read_bytes()
    assert api(web_workspace.url, f"/api/runs/{path_of(web_workspace, 'baseline')}/media") == {
        "id": web_workspace.ids["baseline"],
        "media": [],
    }


def test_pages_carry_no_run_data_and_load_nothing_remote(web_workspace):
    pages = ["/", f"/runs/{path_of(web_workspace, 'baseline')}"]
    for page in pages:
        status, headers, body = http_get(web_workspace.url, page)
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in headers["content-security-policy"]
        assert headers["x-content-type-options"] == "nosniff"
        text = body.decode()
        assert HOSTILE_TAG not in text and "onerror" not in text
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "a page loads something remote"
        for asset in re.findall(r"""(?:src|href)="(/static/[^"]+)""", text):
            assert http_get(web_workspace.url, asset)[0] == 200, asset
    status, headers, body = http_get(web_workspace.url, "/api/runs")
    assert headers["content-type"] == "application/json" and json.dumps(HOSTILE_TAG)[1:-1].encode() in body
    vendored = Path(__file__).parents[2] / "perdure" / "web" / "static" / "vendor"
    assert (vendored / "uPlot.LICENSE").read_text().startswith("The MIT License")


def test_unknown_runs_are_404(web_workspace):
    for path in ("/runs/nope/nothing", "/api/runs/nope/nothing", "/api/runs/nope/nothing/metrics", "/nope"):
        status, _, body = http_get(web_workspace.url, path)
        assert (status, body) == (404, b"Not Found"), path
