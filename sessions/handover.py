"""Ending a dead engine's leases at once, for whoever knows that it is dead.

An engine's claim on a running turn is a pending entry of the work queue's
consumer group that it keeps fresh; another engine takes the turn over from the
token log once the entry has been idle a whole lease (10 s by default), as it
must when all it knows is that the heartbeats stopped. A supervisor knows more:
``wsinfer serve`` saw its engine child exit, or it holds the lock of a data
directory whose private Redis lists engines of the run before, none of which
can be alive. It hands their turns over here: each pending entry is marked idle
for far longer than any lease, and the engine marked dead, so the next engine's
first takeover scan (the first thing it does) claims every turn without waiting.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from wsinfer.sessions import keys
from wsinfer.sessions.schema import as_str

# Longer than any lease: XAUTOCLAIM's min-idle-time is passed at once.
EXPIRED_IDLE_MS = 1_000_000_000
PAGE = 1000


async def registered_engines(redis: aioredis.Redis) -> list[str]:
    """Every engine the registry lists, alive or not."""
    return [as_str(name) for name in await redis.zrange(keys.ENGINES, 0, -1)]


async def last_heartbeat(redis: aioredis.Redis, engine_id: str) -> float | None:
    """The engine's last heartbeat (unix seconds), None before its first."""
    score = await redis.zscore(keys.ENGINES, engine_id)
    return None if score is None else float(score)


async def hand_over(redis: aioredis.Redis, engine_ids: list[str]) -> int:
    """End the leases of ``engine_ids``, which the caller knows are dead.

    Returns how many turns of the shared queue they held; their own queues
    (turns routed to their KV caches) are drained by the others once they are
    marked dead, which this does too."""
    handed = 0
    for engine in engine_ids:
        await redis.zadd(keys.ENGINES, {engine: 0})  # dead as of long ago
        handed += await _expire_pending(redis, keys.REQUESTS, engine)
    return handed


async def _expire_pending(redis: aioredis.Redis, stream: str, engine: str) -> int:
    expired, start = 0, "-"
    while True:
        try:
            pending = await redis.xpending_range(
                stream, keys.ENGINE_GROUP, start, "+", PAGE, consumername=engine
            )
        except aioredis.ResponseError:  # no queue or group yet: nothing was held
            return expired
        ids: list[Any] = [entry["message_id"] for entry in pending]
        if ids:
            # Claimed to the same consumer: only the idle time changes, and the
            # delivery count stays (JUSTID), so the takeover looks as it would
            # after a lease ran out.
            await redis.xclaim(
                stream, keys.ENGINE_GROUP, engine, 0, ids, idle=EXPIRED_IDLE_MS, justid=True
            )
        expired += len(ids)
        if len(ids) < PAGE:
            return expired
        start = f"({as_str(ids[-1])}"  # the next page, after this one's last entry
