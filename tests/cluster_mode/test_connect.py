"""The frontend's cluster client under a burst: more commands at once on one
node than redis-py opens connections to it by default (100) all run."""

from __future__ import annotations

import asyncio

from tests.cluster import needs_cluster_tools
from wsinfer.sessions import keys
from wsinfer.sessions.connect import async_client, ready

pytestmark = needs_cluster_tools


async def test_a_burst_of_commands_on_one_node_all_run(redis_url: str) -> None:
    client = async_client(redis_url)
    await ready(client)  # as a frontend does before serving
    stream = keys.REQUESTS  # where every turn start of every frontend goes
    await asyncio.gather(*(client.xadd(stream, {"n": n}) for n in range(300)))
    assert await client.xlen(stream) == 300
    await client.aclose()
