"""Every test here runs on a real 3-primary Redis Cluster: ``redis_url`` names it.

An engine per test here, not one per module: ``redis_url`` flushes the cluster
before each test, and tests kill primaries under the engine.
"""

from collections.abc import Iterator

import pytest

from tests.cluster import cluster, redis_client, redis_url  # noqa: F401
from tests.conftest import MODULE_ENGINE
from tests.stack import Stack


@pytest.fixture
def stack(redis_url: str, tiny_model: str) -> Iterator[Stack]:  # noqa: F811
    """A stack with a running engine on the cluster (what tests/wsinfer's ``stack`` is)."""
    running = Stack(redis_url, tiny_model)
    try:
        running.start_engine(MODULE_ENGINE)
        yield running
    finally:
        running.stop()


@pytest.fixture
def engine(stack: Stack) -> Stack:
    """A running engine on the cluster (for fixtures that only need one to exist)."""
    return stack
