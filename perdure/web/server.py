"""Running the viewer: bind the socket (a clear error when the port is taken), scan the workspace, serve with uvicorn.

uvicorn is a well-kept ASGI server; binding the socket here first lets a busy port or a bad host name fail with a
message that says what to do, and lets `--port 0` pick a free port whose URL is printed.
"""

from __future__ import annotations

import socket
import sys
import threading
import webbrowser
from pathlib import Path

import uvicorn

from perdure.errors import PerdureError
from perdure.loopback import is_loopback
from perdure.web.app import LOOPBACK_HOSTS, create_app
from perdure.web.workspace_view import WorkspaceView
from perdure.workspace.registry import missing_root


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); `PerdureError` naming the fix when that is impossible."""
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise PerdureError(
            f"--host {host!r}: cannot resolve it ({error.strerror}); give an address such as 127.0.0.1"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise PerdureError(
            f"cannot listen on {host}:{port}: {error.strerror}; pass another --port (0 picks a free one)"
        ) from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    if host in ("0.0.0.0", "[::]"):
        host = socket.gethostname()
    return f"http://{host}:{port}/"


def serve(
    root: Path | str | None,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    open_browser: bool = False,
    stale_after: float = 600.0,
) -> None:
    """Serve the workspace at `root` until interrupted. Prints the URL (and a warning when `host` is not loopback)."""
    view = WorkspaceView(root, stale_after=stale_after)
    if not view.root.is_dir():
        raise PerdureError(missing_root(view.registry.root))
    report = view.scan()
    loopback = is_loopback(host)
    if not loopback:
        print(
            f"warning: serving on {host}, not on loopback: anyone who can reach port {port} of this machine can read "
            "every run under the workspace root (configs, logs, metrics, images). Use --host 127.0.0.1 to keep it "
            "local, or an SSH tunnel to look from elsewhere.",
            file=sys.stderr,
        )
    sock = bind(host, port)
    url = url_of(sock)
    skipped = f", {len(report['skipped'])} unreadable sidecar(s) skipped" if report["skipped"] else ""
    print(f"perdure web: {report['found']} run(s) under {view.root}{skipped}", flush=True)
    print(f"perdure web: serving on {url} (read-only; Ctrl-C to stop)", flush=True)
    app = create_app(view, allowed_hosts=LOOPBACK_HOSTS if loopback else None)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    if open_browser:
        threading.Timer(0.5, webbrowser.open, args=(url,)).start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        view.close()
