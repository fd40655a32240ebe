"""Free local ports for the servers tests start (Redis, nginx, frontends)."""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path


def free_ports(count: int, exclude: list[int] | None = None) -> list[int]:
    """Ports free now, and outside the range the kernel hands to outgoing
    connections: a port from ``bind(0)`` is an ephemeral one, and any of the
    suite's many client sockets can take it before redis-server binds it.
    The cluster bus listens on port + 10000, so that must be free too."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(1024, 65536 - 10000) if _outside(p, low, high)]
    ports: list[int] = []
    for port in random.sample(candidates, len(candidates)):
        if len(ports) == count:
            break
        if port not in (exclude or []) and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


def _ephemeral_range() -> tuple[int, int]:
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999  # Linux's default


def _outside(port: int, low: int, high: int) -> bool:
    return all(not low <= p <= high for p in (port, port + 10000))


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
