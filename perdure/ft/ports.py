"""Where a replica group listens: on the address it advertises to the other groups, never on every interface.

A group's rank 0 opens three ports: torchft's ManagerServer (the group's ranks ask it for the quorum; the lighthouse
sends it the dashboard's kill), the TCPStore of a one-process group (the quorum's other groups connect to the
primary's store), and the HTTP server a healing group downloads the full training state from. torchft binds the first
and the last to every interface (`[::]`, `""`) and advertises the machine's host name; torch's TCPStore listens on
every interface too. perdure binds each to the one address the rank advertises (MASTER_ADDR when it is this
machine's, else the host name; `own_address`): a group on 127.0.0.1 is reachable from this machine only, and a group
on a cluster's interface is not also reachable on every other one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import ThreadingHTTPServer
from typing import Any, cast

from perdure.errors import PerdureError


def own_address(master: str | None) -> tuple[str, str]:
    """(host, ip): the address this rank advertises for its ports and the IP they listen on. `MASTER_ADDR` when it is
    an address of this machine (always for a one-process group, and for the rank 0 of a group torchrun started), else
    the host name, as torchft itself advertises it."""
    if master:
        ip = _resolved(master)
        if ip is not None and _can_listen(ip):
            return master, ip
    host = socket.gethostname()
    ip = _resolved(host)
    if ip is None or not _can_listen(ip):
        raise PerdureError(
            f"cannot tell this machine's address for the replica group's ports: MASTER_ADDR is {master!r} and the host "
            f"name {host!r} resolves to {ip or 'nothing'}. Set MASTER_ADDR to this machine's address on the network "
            "the groups share (127.0.0.1 when they all run here)"
        )
    return host, ip


def _resolved(host: str) -> str | None:
    try:
        # an IPv4 / IPv6 socket address, whose host is a str (typeshed's union also has AF_PACKET's int)
        return cast(str, socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)[0][4][0])
    except (socket.gaierror, IndexError):
        return None


def _can_listen(ip: str) -> bool:
    try:
        listening_socket(ip).close()
    except OSError:
        return False
    return True


def host_port(ip: str, port: int) -> str:
    """`ip:port`, with an IPv6 address in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def listening_socket(ip: str) -> socket.socket:
    """A TCP socket listening on (ip, a free port)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.listen(1024)
    return sock


def store_on(ip: str, host: str, timeout: timedelta) -> tuple[Any, socket.socket]:
    """(the master TCPStore of a one-process group listening on `ip` only, its socket: keep both alive)."""
    import torch.distributed as dist

    sock = listening_socket(ip)
    store = dist.TCPStore(
        host, sock.getsockname()[1], is_master=True, wait_for_workers=False, timeout=timeout,
        master_listen_fd=sock.fileno(),
    )  # fmt: skip
    return store, sock


@contextlib.contextmanager
def manager_server_on(ip: str) -> Iterator[None]:
    """While torchft's `Manager` is built: its ManagerServer binds to `ip` (torchft hard-codes `[::]:<port>` and has
    no setting for it; only the port, `TORCHFT_MANAGER_PORT`, is kept)."""
    import torchft.manager as module

    server_class = module.ManagerServer

    def bound(*args: Any, bind: str, **kwargs: Any) -> Any:
        return server_class(*args, bind=host_port(ip, int(bind.rsplit(":", 1)[1])), **kwargs)

    module.ManagerServer = bound
    try:
        yield
    finally:
        module.ManagerServer = server_class


def rebind_transport(transport: Any, ip: str) -> None:
    """Move the HTTP server of a torchft `HTTPTransport` (bound to every interface when it was made, before any state
    was offered) to `ip`."""
    handler = transport._server.RequestHandlerClass
    transport._server.shutdown()
    transport._thread.join()
    transport._server.server_close()

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        request_queue_size = 1024

    transport._server = Server((ip, 0), handler)
    transport._thread = threading.Thread(target=transport._serve, daemon=True)
    transport._thread.start()
