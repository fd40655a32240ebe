"""What the request handlers need of a client connection, whatever its transport.

A WebSocket ``Connection`` (server.py) and an HTTP request's ``HttpPeer``
(http/peer.py) both provide it, so ``Handlers`` runs the same session
operations for both doors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from wsinfer.protocol import ConnectionProtocol
    from wsinfer.server import Frontend


class Peer(Protocol):
    frontend: Frontend
    protocol: ConnectionProtocol
    id: str
    log: Any
    congested: bool  # its client is not reading: new subscriptions start paused

    def started_turn(self, session: str, turn: int) -> None: ...

    def on_events(self, session: str, turn: int) -> Any: ...
