"""Every test here runs on a real 3-primary Redis Cluster: ``redis_url`` names it."""

from tests.cluster import cluster, redis_client, redis_url  # noqa: F401
from tests.wsinfer.test_server_e2e import engine, stack, tiny_model  # noqa: F401
