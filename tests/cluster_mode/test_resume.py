"""The random-cut resume test, unchanged, on a real 3-primary Redis Cluster."""

from tests.cluster import (  # noqa: F401  (fixtures)
    cluster,
    needs_cluster_tools,
    redis_client,
    redis_url,
)
from tests.wsinfer.test_server_e2e import (  # noqa: F401  (fixtures and the test itself)
    engine,
    frontend,
    stack,
    test_resume_after_cuts_at_random_points_loses_and_repeats_nothing,
    tiny_model,
)

pytestmark = needs_cluster_tools
