"""Engine failover (kill -9 mid-turn), unchanged, on a real 3-primary Redis Cluster."""

from tests.cluster import needs_cluster_tools
from tests.engine.test_failover import (  # noqa: F401  (its fixture and the test itself)
    frontend,
    test_kill_9_mid_turn_is_invisible_to_the_client,
)

pytestmark = needs_cluster_tools
