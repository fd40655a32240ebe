"""A dead engine's leases ended at once: the next engine's takeover scan claims its
turns without waiting out the lease, and leaves a live engine's alone."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis

from wsinfer.sessions import keys
from wsinfer.sessions.handover import hand_over, last_heartbeat, registered_engines
from wsinfer.sessions.worker import WorkerStore

LEASE_MS = 60_000  # far longer than the test: only a hand-over can free a turn


def queue_turns(client: redis.Redis, count: int) -> None:
    for i in range(count):
        client.xadd(keys.REQUESTS, {"i": str(i)})


async def test_a_handed_over_engine_s_turns_are_taken_at_once(
    redis_client: redis.Redis, aredis: aioredis.Redis
) -> None:
    dead, alive, taker = (WorkerStore(redis_client, name) for name in ("dead", "alive", "taker"))
    dead.ensure_group()
    queue_turns(redis_client, 1005)  # more than one page of pending entries
    for store, count in ((dead, 1003), (alive, 2)):
        store.heartbeat()
        redis_client.xreadgroup(keys.ENGINE_GROUP, store.engine_id, {keys.REQUESTS: ">"}, count)
    assert sorted(await registered_engines(aredis)) == ["alive", "dead"]

    assert await hand_over(aredis, ["dead"]) == 1003
    assert await last_heartbeat(aredis, "dead") == 0.0  # dead as of long ago
    assert (await last_heartbeat(aredis, "alive") or 0) > 0
    claimed = 0
    while batch := redis_client.xautoclaim(
        keys.REQUESTS, keys.ENGINE_GROUP, taker.engine_id, LEASE_MS, "0-0", count=500
    )[1]:
        claimed += len(batch)
    assert claimed == 1003  # every one of the dead engine's, none of the live one's
    pending = redis_client.xpending(keys.REQUESTS, keys.ENGINE_GROUP)
    owners = {c["name"].decode(): c["pending"] for c in pending["consumers"]}
    assert owners == {"taker": 1003, "alive": 2}


async def test_handing_over_an_engine_that_held_nothing(aredis: aioredis.Redis) -> None:
    assert await hand_over(aredis, ["never-started"]) == 0  # no queue, no group yet
    assert await last_heartbeat(aredis, "never-started") == 0.0
