"""A TCP proxy for tests that cuts its connections on demand.

Each connection goes to an upstream that accepts it (tried in a random order,
as a load balancer spreads clients), and ``cut()`` aborts every connection it
carries at once, both sides, without a closing handshake: what a client sees
when a network path or a frontend dies. The client behind it reconnects
through the proxy by itself (the Python client, a browser's ``EventSource``)
or by the test's own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random


class Cutter:
    def __init__(self, upstreams: list[int], rng: random.Random | None = None) -> None:
        self.upstreams = upstreams
        self.rng = rng or random.Random(0)
        self.port = 0
        self.connections = 0  # accepted and joined to an upstream, over its life
        self._server: asyncio.Server | None = None
        self._live: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._handlers: set[asyncio.Task[None]] = set()  # one per accepted connection

    async def start(self) -> Cutter:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self, linger: float = 0.0) -> int:
        """Abort every connection now; how many there were.

        With ``linger``, only the client's side goes now: the server's side
        stays open, its data read and dropped, for that many seconds, as when
        a client vanishes without a word and the server learns it only later.
        """
        pairs, self._live = self._live, set()
        loop = asyncio.get_running_loop()
        for client, upstream in pairs:
            client.transport.abort()
            if linger > 0:
                loop.call_later(linger, upstream.transport.abort)
            else:
                upstream.transport.abort()
        return len(pairs)

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._handlers, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            await self._join(reader, writer)
        finally:
            self._handlers.discard(handler)

    async def _join(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self._dial()
        if upstream is None:
            writer.transport.abort()
            return
        up_reader, up_writer = upstream
        pair = (writer, up_writer)
        self._live.add(pair)
        self.connections += 1
        pumps = [
            asyncio.create_task(_pump(reader, up_writer)),
            asyncio.create_task(_pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
            self._tasks.discard(task)
        self._live.discard(pair)
        for w in pair:
            w.close()

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for port in self.rng.sample(self.upstreams, len(self.upstreams)):
            with contextlib.suppress(OSError):
                return await asyncio.open_connection("127.0.0.1", port)
        return None


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError):
        while data := await reader.read(65536):
            if writer.transport.is_closing():
                continue  # cut with a linger: read on, as the vanished peer's kernel would
            writer.write(data)
            await writer.drain()
    # EOF from one side: pass the half-close on, as TCP would.
    with contextlib.suppress(OSError, RuntimeError):
        writer.write_eof()
