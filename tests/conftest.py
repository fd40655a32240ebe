"""Fixtures shared by every test: real Redis servers, and one engine per module.

``redis_url`` is a redis-server of the test's own (cheap: a few milliseconds).
An engine is not cheap (it imports torch and loads a model: seconds, more on
a loaded machine), so tests that only need *an* engine share the module's
``module_stack`` through ``engine_stack``, which deletes every session after
each test: the next test sees a warm engine and an empty Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from tests.models import tiny_model_dir
from tests.stack import Stack, forget_sessions
from wsinfer.supervisor import EmbeddedRedis

# The engine id of the module's shared engine.
MODULE_ENGINE = "engine-1"


def _embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedRedis:
    # Short path: unix socket paths are limited to ~100 bytes.
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("redis", numbered=True)))
    server.start()
    return server


@pytest.fixture
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server of this test's own, on a unix socket: no flushing, no sharing."""
    server = _embedded_redis(tmp_path_factory)
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


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """The tiny random Llama (built once per machine, then cached)."""
    return str(tiny_model_dir())


@pytest.fixture
def stack(redis_url: str, tiny_model: str) -> Iterator[Stack]:
    """Nothing running yet on the test's own Redis: for tests that start engines
    with flags of their own, or kill them. Every process is stopped after."""
    stack = Stack(redis_url, tiny_model)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def module_redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Redis of the module's shared engine (tests/cluster_mode: a cluster)."""
    server = _embedded_redis(tmp_path_factory)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def module_stack(module_redis_url: str, tiny_model: str) -> Iterator[Stack]:
    """One tiny-model engine (``MODULE_ENGINE``) serving every test of a module."""
    stack = Stack(module_redis_url, tiny_model)
    try:
        stack.start_engine(MODULE_ENGINE)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def engine_stack(module_stack: Stack) -> Iterator[Stack]:
    """The module's engine, for one test.

    Processes the test starts on it are stopped after the test, and every
    session is deleted (the engine stays registered): isolation by a clean
    Redis, as with ``redis_url``, without paying for an engine per test.
    """
    stack = Stack(module_stack.redis_url, module_stack.model)
    try:
        yield stack
    finally:
        stack.stop()
    module_stack.check_alive()
    forget_sessions(module_stack.redis_url)
