"""One port for WebSocket and HTTP: look at each connection's first request, then hand over.

websockets' ``serve()`` owns the listening socket and builds each connection
through ``create_connection``; ``FrontDoor`` is that connection class. Until a
whole request head has arrived it only buffers. A WebSocket opening handshake
is then replayed, byte for byte, into the ordinary websockets connection, which
from there on runs exactly as if nothing had looked first (same object, same
transport: the relay's speed is websockets' own). Any other request moves the
transport to an h11 ``HttpConnection`` of the ``HttpApp``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, cast

import h11
from websockets.asyncio.server import ServerConnection

from wsinfer.http.connection import HEAD_TIMEOUT_S, wants_websocket

if TYPE_CHECKING:
    from wsinfer.http.app import HttpApp


class FrontDoor(ServerConnection):
    app: HttpApp  # bound per frontend by ``front_door``

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sniffing = True
        self._head = bytearray()
        self._parser: h11.Connection | None = h11.Connection(h11.SERVER)
        self._raw_transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A client that has not sent a whole first request head by then is dropped
        # (slowloris); the HTTP connection times each later head the same way.
        self._raw_transport = cast(asyncio.Transport, transport)
        self._timer = self.loop.call_later(HEAD_TIMEOUT_S, self._raw_transport.abort)

    def data_received(self, data: bytes) -> None:
        if not self._sniffing:
            super().data_received(data)
            return
        assert self._parser is not None and self._raw_transport is not None
        self._head += data
        self._parser.receive_data(data)
        try:
            event = self._parser.next_event()
        except h11.RemoteProtocolError:
            event = None  # the HTTP side answers it with a 400
        if event is h11.NEED_DATA:
            return
        self._stop_sniffing()
        raw, self._head = bytes(self._head), bytearray()
        if isinstance(event, h11.Request) and _is_websocket(event):
            self.become_websocket(raw)
        else:
            self.app.take(self._raw_transport, raw, self.become_websocket)

    def become_websocket(self, raw: bytes) -> None:
        """From here on, websockets' own connection: it parses and answers the handshake."""
        assert self._raw_transport is not None
        self._sniffing = False
        self._raw_transport.set_protocol(self)
        super().connection_made(self._raw_transport)
        super().data_received(raw)

    def _stop_sniffing(self) -> None:
        self._sniffing = False
        self._parser = None
        if self._timer is not None:
            self._timer.cancel()

    def eof_received(self) -> None:
        if not self._sniffing:  # while sniffing, returning None closes the transport
            super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._sniffing:
            self._stop_sniffing()
            return
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        if not self._sniffing:
            super().pause_writing()

    def resume_writing(self) -> None:
        if not self._sniffing:
            super().resume_writing()


def _is_websocket(event: h11.Request) -> bool:
    headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
    method, upgrade = event.method.decode("latin-1"), headers.get("upgrade", "")
    chunked = "transfer-encoding" in headers
    return wants_websocket(method, upgrade, headers.get("content-length"), chunked)


def front_door(app: HttpApp) -> type[FrontDoor]:
    """The ``create_connection`` class for ``serve()``, bound to this frontend's HTTP app."""
    return type("BoundFrontDoor", (FrontDoor,), {"app": app})
