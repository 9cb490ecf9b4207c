"""`perdure web` is read-only and never serves a byte from outside the workspace root (see conftest.py for the files
an attacker planted: symlinks out of the root in a run's media/ and logs/, media.jsonl lines whose paths leave)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.web.client import SECRET, api, http_get


def id_path(run_id: str) -> str:
    return "/".join(quote(part, safe="") for part in run_id.split("/"))


def assert_refused(url: str, path: str) -> None:
    status, _, body = http_get(url, path)
    assert status == 404, f"{path}: {status} {body[:200]!r}"
    assert SECRET.encode() not in body and b"root:" not in body, path


def test_traversal_and_symlinks_are_404_without_content(web_workspace):
    run = id_path(web_workspace.ids["images"])
    secret = web_workspace.secret
    hops = "/".join([".."] * 5)
    attempts = [
        f"/files/{run}/../../../{secret.name}",
        f"/files/{run}/media/../../../{secret.name}",
        f"/files/{run}/media/{hops}{secret}",
        f"/files/{run}/%2e%2e/%2e%2e/%2e%2e/{secret.name}",
        f"/files/{run}/media/%2e%2e%2f%2e%2e%2f%2e%2e%2f{secret.name}",
        f"/files/{run}/media/..%2f..%2f..%2f{secret.name}",
        f"/files/{run}/%2F{str(secret).lstrip('/')}",
        f"/files/{run}/{secret}",  # an absolute path after the run id
        f"/files/{run}//etc/passwd",
        f"/files/{run}/media/leak.png",  # a symlink planted in the run's media/, pointing outside the root
        f"/files/{run}/sidecar.json",  # inside the run, but not media
        f"/files/{run}/metrics.csv",
        f"/files/{run}/media",
        f"/files/{run}/media/",
        f"/api/runs/{run}/log?name=leak.log",  # a symlinked log file
        f"/api/runs/{run}/log?name=../../../{secret.name}",
        f"/api/runs/{run}/log?name={quote(str(secret), safe='')}",
        "/static/../perdure/web/app.py",
        "/static/%2e%2e/app.py",
        "/static/..%2fapp.py",
        f"/runs/%2e%2e/%2e%2e{secret}",
        "/api/runs/../../etc/passwd",
        "/../../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        str(secret),
    ]
    for path in attempts:
        assert_refused(web_workspace.url, path)


def test_a_symlinked_run_dir_out_of_the_root_is_not_served(web_workspace, tmp_path):
    outside = tmp_path / "outside-run"
    shutil.copytree(web_workspace.root / web_workspace.ids["images"], outside, symlinks=True)
    planted = web_workspace.root / "evil-group" / "evil-run"
    planted.parent.mkdir()
    planted.symlink_to(outside)
    try:
        listed = [row["id"] for row in api(web_workspace.url, "/api/runs")["runs"]]
        assert "evil-group/evil-run" not in listed and len(listed) == 6
        evil = "evil-group/evil-run"
        for path in (f"/runs/{evil}", f"/api/runs/{evil}", f"/api/runs/{evil}/media"):
            assert_refused(web_workspace.url, path)
        media = next((outside / "media" / "samples_pattern").iterdir()).name
        assert_refused(web_workspace.url, f"/files/evil-group/evil-run/media/samples_pattern/{media}")
    finally:
        planted.unlink()
        planted.parent.rmdir()


def test_hostile_media_index_lines_are_not_listed(web_workspace):
    media = api(web_workspace.url, f"/api/runs/{id_path(web_workspace.ids['images'])}/media")["media"]
    assert media and not [item for item in media if item["tag"] == "attack" or "leak" in item["url"]]


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` (except under `skip`, the live run) with its size and mtime."""
    files = {}
    for directory, _, names in os.walk(root):
        if Path(directory).is_relative_to(skip):
            continue
        for name in names:
            path = Path(directory) / name
            if name.startswith("registry.db"):
                continue  # the registry's cache, rebuilt from the sidecars at will
            info = path.lstat()
            files[str(path.relative_to(root))] = (info.st_size, info.st_mtime_ns)
    return files


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_no_route_changes_anything(web_workspace, method):
    live = web_workspace.root / web_workspace.ids["live"]
    before = snapshot(web_workspace.root, live)
    run = id_path(web_workspace.ids["baseline"])
    for path in ("/api/runs", f"/api/runs/{run}", f"/api/runs/{run}/metrics", f"/runs/{run}", "/"):
        status, headers, _ = http_get(web_workspace.url, path, method=method)
        assert status == 405 and headers["allow"] == "GET, HEAD", (method, path, status)
    for path in ("/", "/api/runs?rescan=full", f"/api/runs/{run}", f"/api/runs/{run}/log"):
        assert http_get(web_workspace.url, path)[0] == 200
    assert snapshot(web_workspace.root, live) == before


def test_foreign_host_headers_are_refused(web_workspace):
    """DNS rebinding: a page on another site resolving its name to 127.0.0.1 must not read the runs."""
    status, _, body = http_get(web_workspace.url, "/api/runs", headers={"Host": "attacker.example:8765"})
    assert status == 400 and b"runs" not in body
    for host in ("127.0.0.1:1234", "localhost", "[::1]:8765"):
        assert http_get(web_workspace.url, "/api/runs", headers={"Host": host})[0] == 200, host
