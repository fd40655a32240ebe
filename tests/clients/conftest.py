"""Fixtures for the client tests: the scripted stand-in server (standin.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from .standin import StandIn


@pytest.fixture
async def fake_server() -> AsyncIterator[StandIn]:
    server = await StandIn().start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def keyed_server() -> AsyncIterator[StandIn]:
    server = await StandIn(api_key="sekret").start()
    try:
        yield server
    finally:
        await server.stop()


class ThreadedServer:
    """A StandIn on its own loop in a thread, for blocking (sync) clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: StandIn = self.call(StandIn().start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def close(self) -> None:
        self.call(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture
def threaded_server() -> Iterator[StandIn]:
    threaded = ThreadedServer()
    try:
        yield threaded.server
    finally:
        threaded.close()
