"""Whether a host name or address reaches this machine only: the servers perdure starts (the web viewer, the TorchFT
lighthouse) listen on loopback unless asked otherwise, and warn when they are not."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only (127.0.0.0/8, ::1, localhost)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
