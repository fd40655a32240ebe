"""Fixtures shared by every test: real Redis servers, private to each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from wsinfer.supervisor import EmbeddedRedis


@pytest.fixture
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of this test's own, on a unix socket: no flushing, no sharing."""
    # Short path: unix socket paths are limited to ~100 bytes.
    state = Path(tmp_path_factory.mktemp("redis", numbered=True))
    server = EmbeddedRedis(state)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()
