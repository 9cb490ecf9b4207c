"""`perdure web [--root DIR] [--host 127.0.0.1] [--port 8765] [--open]`: browse the runs of a workspace in a browser.

Read-only. Bound to 127.0.0.1 unless `--host` says otherwise. Needs the `web` extra (`pip install 'perdure[web]'`).
"""

from __future__ import annotations

import argparse
import sys

WEB_EXTRA_HINT = "perdure web needs the web extra, which is not installed: pip install 'perdure[web]'"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `web` to the `perdure` command's subparsers."""
    parser = subparsers.add_parser("web", help="browse runs, curves and images in a browser", description=__doc__)
    parser.add_argument("--root", help="workspace root (default: $PERDURE_ROOT, else ./runs)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine)")
    parser.add_argument("--port", type=int, default=8765, help="port to listen on (default: 8765; 0 picks a free one)")
    parser.add_argument("--open", action="store_true", help="open the viewer in the default browser")
    parser.add_argument(
        "--stale-after",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="show a running run as stale when its heartbeat is older than this (default: 600)",
    )
    parser.set_defaults(handler=cmd_web)
    return parser


def cmd_web(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C."""
    try:
        from perdure.web.server import serve
    except ImportError as error:
        if error.name not in ("starlette", "uvicorn") and not str(error.name).startswith(("starlette.", "uvicorn.")):
            raise
        print(f"error: {WEB_EXTRA_HINT} (missing module: {error.name})", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"error: --port {args.port}: use a port number from 1 to 65535 (0 picks a free one)", file=sys.stderr)
        return 2
    try:
        serve(args.root, host=args.host, port=args.port, open_browser=args.open, stale_after=args.stale_after)
    except KeyboardInterrupt:
        pass
    return 0
