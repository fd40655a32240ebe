"""Engine failover (kill -9 mid-turn), unchanged, on a real 3-primary Redis Cluster."""

from tests.cluster import needs_cluster_tools

# The root conftest's empty stack, over this folder's (which starts an engine):
# the test starts the two engines it kills one of, and the turn must land on one.
from tests.conftest import stack  # noqa: F401
from tests.engine.test_failover import (  # noqa: F401  (its fixture and the test itself)
    frontend,
    test_kill_9_mid_turn_is_invisible_to_the_client,
)

pytestmark = needs_cluster_tools
