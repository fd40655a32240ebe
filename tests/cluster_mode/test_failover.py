"""Engine failover (kill -9 mid-turn), unchanged, on a real 3-primary Redis Cluster."""

from collections.abc import Iterator

import pytest

from tests.cluster import needs_cluster_tools
from tests.engine.test_failover import (  # noqa: F401  (its fixture and the test itself)
    frontend,
    test_kill_9_mid_turn_is_invisible_to_the_client,
)
from tests.stack import Stack

pytestmark = needs_cluster_tools


@pytest.fixture
def stack(redis_url: str, tiny_model: str) -> Iterator[Stack]:
    """No engine yet (the cluster's ``stack`` starts one): the test starts the two
    it kills one of, and the turn must land on one of them."""
    empty = Stack(redis_url, tiny_model)
    try:
        yield empty
    finally:
        empty.stop()
