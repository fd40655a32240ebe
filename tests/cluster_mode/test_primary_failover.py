"""A Redis Cluster primary dies mid-turn: its replica takes over, and the
client still sees exactly the uninterrupted text. Also: the fan-in holds one
pub/sub connection per node, however many sessions it follows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.cluster import LocalCluster, needs_cluster_tools
from tests.stack import Client, joined, start_frontend
from tests.wsinfer.test_server_e2e import PROMPT
from wsinfer.fanin_cluster import ClusterFanIn
from wsinfer.server import Frontend
from wsinfer.sessions import keys

pytestmark = needs_cluster_tools
GREEDY = {"temperature": 0, "max_new_tokens": 300}


@pytest.fixture
async def frontend(redis_url: str, engine: object) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(redis_url)
    yield frontend
    await frontend.stop()


async def test_fanin_reads_with_one_connection_per_node(frontend: Frontend) -> None:
    fanin = frontend.fanin
    assert isinstance(fanin, ClusterFanIn)
    clients = [await Client.open(frontend.port) for _ in range(12)]
    for c in clients:
        await c.send(
            type="generate", messages=PROMPT, params={"temperature": 0, "max_new_tokens": 40}
        )
    for c in clients:
        await c.recv()
    # The fan-in places its listeners at the start of its next round.
    deadline = asyncio.get_running_loop().time() + 30
    while len(fanin.listeners) < 2 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    followed = {keys.session_of(s) for s in fanin.streams}
    # 12 sessions spread over 3 primaries: never more listeners than nodes.
    assert 1 < len(fanin.listeners) <= 3 and len(followed) >= 2
    texts = [joined(await c.until("done"))[0] for c in clients]
    assert all(texts) and len(set(texts)) == 1  # same prompt, greedy: same text
    for c in clients:
        await c.close()


async def test_primary_failover_mid_turn_loses_and_repeats_nothing(
    frontend: Frontend, cluster: LocalCluster
) -> None:
    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    reference, _ = joined(await client.until("done"))

    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    session = (await client.recv())["session"]
    head = [await client.recv() for _ in range(3)]
    victim = cluster.primary_of(keys.meta(session))
    cluster.kill(victim)  # kill -9: no goodbye, unreplicated writes may be lost
    await asyncio.to_thread(cluster.wait_failover, victim)
    messages = head + await client.until("done", timeout=180)
    text, _ = joined(messages)
    await client.close()
    assert cluster.primary_of(keys.meta(session)) != victim, "a replica should have taken over"
    assert text == reference
    assert isinstance(frontend.fanin, ClusterFanIn)
