"""Helpers and constants of the web tests: HTTP requests sent exactly as written (no client-side normalisation)."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit

# A run tag that would run script if a page ever parsed run data as HTML.
HOSTILE_TAG = '<img src=x onerror="window.__pwned=1">'
# The content of a file outside the workspace root, which no route may ever serve.
SECRET = "TOP-SECRET-CONTENT-OUTSIDE-THE-ROOT"


def http_get(url: str, path: str, *, method: str = "GET", headers: dict[str, str] | None = None):
    """(status, headers, body) of a request sent exactly as written: no client-side normalisation of `path`."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.putrequest(method, path, skip_host=headers is not None and "Host" in headers)
        for name, value in (headers or {}).items():
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def api(url: str, path: str) -> Any:
    status, _, body = http_get(url, path)
    assert status == 200, (path, status, body[:300])
    return json.loads(body)
