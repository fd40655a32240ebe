"""Engine failover (kill -9 mid-turn), unchanged, on a real 3-primary Redis Cluster."""

from tests.cluster import (  # noqa: F401  (fixtures)
    cluster,
    needs_cluster_tools,
    redis_client,
    redis_url,
)
from tests.engine.test_failover import (  # noqa: F401  (fixtures and the test itself)
    frontend,
    stack,
    test_kill_9_mid_turn_is_invisible_to_the_client,
)

pytestmark = needs_cluster_tools
