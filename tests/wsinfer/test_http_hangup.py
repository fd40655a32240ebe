"""A streamed response stops, and its cleanup runs, when its client hangs up, even
where the cancel that should stop it is lost on the way (``asyncio.wait_for`` on
Python 3.10 and 3.11 drops one that lands as its awaited result comes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import h11

from wsinfer.http.connection import HttpConnection, HttpRequest, HttpResponse


class DeafStream:
    """An app whose one response streams for 10 s and swallows every cancel."""

    def __init__(self) -> None:
        self.cleaned = asyncio.Event()

    async def handle(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, stream=self._chunks(), cleanup=self.cleaned.set)

    async def _chunks(self) -> AsyncIterator[bytes]:
        for _ in range(1000):
            with contextlib.suppress(asyncio.CancelledError):  # the lost cancel
                await asyncio.sleep(0.01)
            yield b"data: x\n\n"

    def refuse(
        self, status: int, message: str, code: str, retry_after: float | None = None
    ) -> HttpResponse:
        return HttpResponse(status, body=message.encode())


class Accept(asyncio.Protocol):
    def __init__(self, app: DeafStream) -> None:
        self.app = app

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        HttpConnection(
            self.app, transport, h11.Connection(h11.SERVER), max_body=1 << 16,
            max_outgoing=1 << 16, request_rate=100.0, upgrade=lambda _: None,
            on_close=lambda _: None,
        ).start()  # fmt: skip


async def test_a_stream_whose_client_hangs_up_ends_though_its_cancel_was_lost() -> None:
    app = DeafStream()
    server = await asyncio.get_running_loop().create_server(lambda: Accept(app), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await reader.readuntil(b"data: x\n\n")
        writer.close()  # hangs up mid-stream
        await asyncio.wait_for(app.cleaned.wait(), 5)
    finally:
        server.close()
        await server.wait_closed()
