"""The random-cut resume test, unchanged, on a real 3-primary Redis Cluster."""

from tests.cluster import needs_cluster_tools
from tests.wsinfer.test_server_e2e import (  # noqa: F401  (its fixture and the test itself)
    frontend,
    test_resume_after_cuts_at_random_points_loses_and_repeats_nothing,
)

pytestmark = needs_cluster_tools
