"""Fixtures shared by every test: real Redis servers, and one engine per module.

``redis_url`` is a redis-server of the test's own (cheap: a few milliseconds).
An engine is not cheap (it imports torch and loads a model: seconds, more on
a loaded machine), so tests that only need *an* engine share the module's
``module_stack`` through ``engine_stack``, which deletes every session after
each test: the next test sees a warm engine and an empty Redis.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from tests.models import tiny_model_dir
from tests.stack import Stack, forget_sessions
from wsinfer.supervisor import EmbeddedRedis

# A `wsinfer serve` that a test starts without a data dir of its own keeps its
# sessions here, never in the user's ~/.local/state/wsinfer.
os.environ.setdefault("WSINFER_DATA_DIR", tempfile.mkdtemp(prefix="wsinfer-test-data-"))

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


# --- the test tiers -------------------------------------------------------------------
#
# ``pytest -m "not slow"`` is the fast tier a developer runs before each commit (a few
# minutes on 2 cores); ``pytest`` (what .ci/run runs) runs both. Slow is whatever
# starts processes (an engine, ``wsinfer serve``, a browser, Redis Cluster or
# Sentinel), loads the real model, builds packages, or explores thousands of
# interleavings. Tests that use these fixtures are marked here; a module or test that
# starts processes itself carries ``pytest.mark.slow``.
SLOW_FIXTURES = frozenset(
    {
        "stack",  # engines and frontends of the test's own
        "module_stack",
        "engine_stack",
        "engine",  # tests/cluster_mode: an engine on a Redis Cluster
        "browser",  # Chromium
        "wsinfer_server",  # tests/browser: a serve for the page
        "smol",  # the real SmolLM2
    }
)


# Modules whose tests start such processes themselves, or explore interleavings.
SLOW_MODULES = frozenset(
    {
        "tests/test_benchmarks.py",  # each benchmark's smoke run, most on a real stack
        "tests/engine/test_engine_metrics.py",  # engine processes, scraped
        "tests/sessions/test_sentinel.py",  # Redis Sentinel and replicas
        "tests/wsinfer/test_http.py",  # a tiny-model serve for the module, the real model
        "tests/wsinfer/test_http_transport.py",
        "tests/wsinfer/test_http_features.py",  # a tiny-model serve for the module
        "tests/wsinfer/test_hostile_clients.py",
        "tests/wsinfer/test_serve.py",
        "tests/wsinfer/test_serve_redis.py",
        "tests/wsinfer/test_logs.py",
        "tests/wsinfer/test_fanin_model.py",  # thousands of fan-in interleavings
        "tests/clients/test_client_model.py",  # thousands of client replay orders
        "tests/clients/test_client_e2e.py",
        "tests/clients/test_readme_resume.py",
        "tests/browser/test_package.py",  # npm's tsc
    }
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath))
    for item in items:
        module = Path(str(item.path)).relative_to(root).as_posix()
        fixtures = getattr(item, "fixturenames", ())
        if module in SLOW_MODULES or SLOW_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.slow)


# Whether the test being set up or run is in the slow tier (outside tests: no guard).
_current_test_is_slow = True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of ``item``, module- and session-scoped ones included."""
    global _current_test_is_slow
    _current_test_is_slow = item.get_closest_marker("slow") is not None


def pytest_runtest_teardown(item: pytest.Item) -> None:
    global _current_test_is_slow
    _current_test_is_slow = True


class _FastTierPopen(subprocess.Popen):  # type: ignore[type-arg]
    """``subprocess.Popen`` for the whole run: in a fast-tier test (its fixtures
    included) a wsinfer process is refused, so a test that starts one and is not
    marked slow fails at once instead of slowing the tier down unnoticed."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        command = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
        if not _current_test_is_slow and command[1:3] == ["-m", "wsinfer"]:
            raise RuntimeError(
                "this test starts a wsinfer process: mark it @pytest.mark.slow "
                "(or list its module or fixture in tests/conftest.py)"
            )
        super().__init__(args, *rest, **kwargs)


subprocess.Popen = _FastTierPopen  # type: ignore[misc]
