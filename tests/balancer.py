"""A tiny TCP load balancer for tests: each connection goes to the next upstream
that accepts it, as a real balancer's health checks would arrange."""

from __future__ import annotations

import asyncio
import contextlib


class Balancer:
    def __init__(self, upstreams: list[int]) -> None:
        self.upstreams = upstreams
        self.port = 0
        self._next = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> Balancer:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = await self._dial()
        if upstream is None:
            writer.close()
            return
        up_reader, up_writer = upstream
        pumps = [
            asyncio.create_task(_pump(reader, up_writer)),
            asyncio.create_task(_pump(up_reader, writer)),
        ]
        self._tasks.update(pumps)
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
            self._tasks.discard(task)
        for w in (writer, up_writer):
            w.close()

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        for _ in range(len(self.upstreams)):
            port = self.upstreams[self._next % len(self.upstreams)]
            self._next += 1
            with contextlib.suppress(OSError):
                return await asyncio.open_connection("127.0.0.1", port)
        return None

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.CancelledError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
