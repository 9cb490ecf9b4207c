"""`perdure ft lighthouse`: torchft's own LighthouseServer, run in the foreground until SIGINT / SIGTERM.

The lighthouse forms a quorum of the live replica groups at every step: a group whose heartbeats stop for
`heartbeat_timeout_ms` is left out of the next quorum, and a group that joins is added. It holds no training state,
so it can be restarted; groups that cannot reach it stop at their next quorum after `ft.quorum_timeout`.

It listens on loopback unless told otherwise: its port also serves torchft's dashboard, which lists the replica
groups and stops any of them on a plain `POST /replica/<id>/kill` (no authentication, no origin check), so another
interface is used only when asked (`--bind HOST:PORT`), with a warning.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from perdure.errors import PerdureError
from perdure.ft.config import FT_EXTRA_HINT
from perdure.loopback import is_loopback

DEFAULT_BIND = "127.0.0.1:29510"
DEFAULT_JOIN_TIMEOUT_MS = 60_000
DEFAULT_HEARTBEAT_TIMEOUT_MS = 5_000
DEFAULT_QUORUM_TICK_MS = 100


def start_lighthouse(
    bind: str = DEFAULT_BIND,
    *,
    min_replicas: int = 1,
    join_timeout_ms: int = DEFAULT_JOIN_TIMEOUT_MS,
    heartbeat_timeout_ms: int = DEFAULT_HEARTBEAT_TIMEOUT_MS,
    quorum_tick_ms: int = DEFAULT_QUORUM_TICK_MS,
) -> Any:
    """A running `torchft.coordination.LighthouseServer`; `.address()` is what groups pass as `ft.lighthouse`,
    `.shutdown()` stops it."""
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise PerdureError(f"perdure ft lighthouse: {FT_EXTRA_HINT}") from None
    for name, value in (
        ("--min-replicas", min_replicas),
        ("--join-timeout-ms", join_timeout_ms),
        ("--heartbeat-timeout-ms", heartbeat_timeout_ms),
        ("--quorum-tick-ms", quorum_tick_ms),
    ):
        if value < 1:
            raise PerdureError(f"{name} {value}: use an integer >= 1")
    try:
        return LighthouseServer(
            bind=bind,
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
    except Exception as error:  # a port in use, an address that is not this host's, ...
        raise PerdureError(
            f"cannot start a lighthouse on {bind} ({error}); use --bind HOST:PORT with a free port of this host"
        ) from None


def address(server: Any, bind: str) -> str:
    """The address groups use: the bound host when `bind` names one (torchft reports the host name, which need not
    resolve to a loopback-only bind), else torchft's `http://<hostname>:<port>`."""
    reported = server.address()
    host = bind.rsplit(":", 1)[0]
    if host in ("", "[::]", "0.0.0.0", "::"):
        return reported
    return f"http://{host}:{reported.rsplit(':', 1)[1]}"


def serve(bind: str, *, announce: Callable[[str], None] = print, **options: int) -> None:
    """Run a lighthouse until SIGINT or SIGTERM; `announce` receives the line that names its address."""
    host = bind.rsplit(":", 1)[0]
    if not is_loopback(host):
        print(
            f"warning: the lighthouse listens on {bind}, not on loopback: anyone who can reach that port sees the "
            "replica groups on torchft's dashboard there and can stop any of them (POST /replica/<id>/kill needs no "
            "authentication). Bind it to the interface the groups use, on a network only they can reach.",
            file=sys.stderr,
            flush=True,
        )
    server = start_lighthouse(bind, **options)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # kept to the end: a second signal never interrupts the shutdown
        signal.signal(sig, lambda *_: stop.set())
    try:
        where = address(server, bind)
        announce(
            f"lighthouse listening on {where} (min replicas {options.get('min_replicas', 1)}, heartbeat timeout "
            f"{options.get('heartbeat_timeout_ms', DEFAULT_HEARTBEAT_TIMEOUT_MS)} ms); groups join with "
            f"--ft.lighthouse {where}"
        )
        # Polled, not one wait: a SIGTERM the kernel hands to one of torchft's threads only marks the handler
        # pending, and a main thread blocked in one long wait would never run it (scancel's SIGTERM was lost so).
        while not stop.wait(0.2):
            pass
    finally:
        server.shutdown()
        announce("lighthouse stopped")
