"""The web viewer's HTTP routes (Starlette): static pages that build themselves from a JSON API.

    GET /                                   runs page (static HTML + JS)
    GET /runs/<id>                          run page (static HTML + JS; 404 for an unknown run)
    GET /api/runs[?rescan=1|full]           {"runs": [...], "root", "scan"}
    GET /api/runs/<id>                      one run: its row plus config, git, attempts, checkpoints, log files
    GET /api/runs/<id>/metrics              {"id", "metrics": {"split/name": {"step", "value", "time"}}, ...}
    GET /api/runs/<id>/media                {"id", "media": [{"tag", "step", "index", "url"}]}
    GET /api/runs/<id>/log[?name=&kib=]     the tail of a log file
    GET /files/<id>/media/...               an image listed by media.jsonl (only under the run's media/)
    GET /static/...                         the pages' own assets, uPlot included (vendored, no CDN)

`<id>` is `<lineage group>/<run dir>`, as `/api/runs` lists it. Every route is read-only (GET / HEAD; anything else
is 405). A path that leaves the workspace root, a symlink out of it, an unknown run, or a file that is not what the
route serves is 404 with no content. Pages carry no run data in their HTML: the scripts fetch JSON and build the DOM
with `textContent`, so a hostile run id, tag or metric name is never parsed as markup.
"""

from __future__ import annotations

import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from perdure.web.files import KIB, Refused
from perdure.web.workspace_view import DEFAULT_MAX_POINTS, WorkspaceView

STATIC_DIR = Path(str(resources.files("perdure.web") / "static"))
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; script-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def create_app(view: WorkspaceView, *, allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS) -> ASGIApp:
    """The viewer as an ASGI app over `view`. `allowed_hosts`: Host header names accepted (None: any), which keeps
    a page on another site from reading the runs through DNS rebinding while the server listens on loopback."""

    def page(name: str) -> FileResponse:
        return FileResponse(STATIC_DIR / name, media_type="text/html; charset=utf-8")

    def run_id(request: Request) -> str:
        return f"{request.path_params['group']}/{request.path_params['run']}"

    def index(request: Request) -> Response:
        return page("index.html")

    def run_page(request: Request) -> Response:
        view.record(run_id(request))
        return page("run.html")

    def api_runs(request: Request) -> Response:
        rescan = request.query_params.get("rescan")
        scan = view.scan(full=rescan == "full") if rescan else None
        return JSONData({"root": str(view.root), "runs": view.runs(), "scan": scan})

    def api_run(request: Request) -> Response:
        return JSONData(view.run(run_id(request)))

    def api_metrics(request: Request) -> Response:
        points = _int_param(request, "max_points", DEFAULT_MAX_POINTS)
        return JSONData(view.metrics(run_id(request), max_points=points))

    def api_media(request: Request) -> Response:
        return JSONData(view.media(run_id(request)))

    def api_log(request: Request) -> Response:
        kib = _int_param(request, "kib", 64)
        return JSONData(view.log(run_id(request), request.query_params.get("name"), kib * KIB))

    def media_file(request: Request) -> Response:
        path, kind = view.media_file(run_id(request), request.path_params["path"])
        return FileResponse(path, media_type=kind, headers={"Cache-Control": "no-cache"})

    def not_found(request: Request, exc: Exception) -> Response:
        return PlainTextResponse("Not Found", status_code=404)

    run = "/{group}/{run}"
    routes = [
        Route("/", index),
        Route(f"/runs{run}", run_page),
        Route("/api/runs", api_runs),
        Route(f"/api/runs{run}", api_run),
        Route(f"/api/runs{run}/metrics", api_metrics),
        Route(f"/api/runs{run}/media", api_media),
        Route(f"/api/runs{run}/log", api_log),
        Route(f"/files{run}/{{path:path}}", media_file),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR, follow_symlink=False), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={Refused: not_found})
    return ViewerGuard(app, allowed_hosts=allowed_hosts)


class JSONData(Response):
    """JSON with non-finite floats sent as null (a NaN read from disk must not break the page)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(key): _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _int_param(request: Request, name: str, default: int) -> int:
    try:
        return max(1, min(int(request.query_params.get(name, default)), 1_000_000))
    except ValueError:
        return default


class ViewerGuard:
    """ASGI middleware: only GET / HEAD, only allowed Host headers, and safety headers on every response."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: tuple[str, ...] | None) -> None:
        self.app = app
        self.allowed_hosts = None if allowed_hosts is None else {host.lower() for host in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["method"] not in ("GET", "HEAD"):
            response = PlainTextResponse("Method Not Allowed: this viewer is read-only", 405, {"Allow": "GET, HEAD"})
            await response(scope, receive, self._with_headers(send))
            return
        if self.allowed_hosts is not None and _host(scope) not in self.allowed_hosts:
            response = PlainTextResponse("Invalid Host header", status_code=400)
            await response(scope, receive, self._with_headers(send))
            return
        await self.app(scope, receive, self._with_headers(send))

    @staticmethod
    def _with_headers(send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [
                    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
                    (b"x-content-type-options", b"nosniff"),
                    (b"referrer-policy", b"no-referrer"),
                    (b"x-frame-options", b"DENY"),
                ]
                if not any(name.lower() == b"cache-control" for name, _ in headers):
                    headers.append((b"cache-control", b"no-store"))
                message = {**message, "headers": headers}
            await send(message)

        return wrapped


def _host(scope: Scope) -> str:
    """The host name of the request's Host header, without port or IPv6 brackets, lower case."""
    for name, value in scope.get("headers", []):
        if name == b"host":
            host = value.decode("latin-1").strip().lower()
            if host.startswith("["):
                return host[1 : host.find("]")] if "]" in host else host
            return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return ""
