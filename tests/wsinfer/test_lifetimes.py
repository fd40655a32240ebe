"""Session lifetimes, end to end: one --session-ttl for frontend and engine,
expired sessions are gone for good, and after any run every key in Redis
either belongs to a live session or process or expires.

Before: the engine reset every session's expiry to 3600 s on each publish, an
expired session could still be resumed, its next turn failed with an
``internal`` message, and per-frontend and per-engine keys never expired."""

from __future__ import annotations

import asyncio
import signal

import pytest
import redis

from tests.stack import Client, Stack

TTL = 3
SHORT = {"temperature": 0, "max_new_tokens": 3}


def keys_without_expiry(client: redis.Redis) -> list[bytes]:
    return [key for key in client.keys("*") if client.ttl(key) == -1]


@pytest.mark.timeout(180)
async def test_one_session_ttl_and_nothing_left_forever(stack: Stack, redis_url: str) -> None:
    client_redis = redis.Redis.from_url(redis_url)
    engine = stack.start_engine("engine-1", "--session-ttl", str(TTL))
    frontend, port = stack.start_frontend("--session-ttl", str(TTL))
    client = await Client.open(port)
    await client.send(type="generate", prompt="Hello", params=SHORT)
    first = await client.recv()
    assert (await client.until("done"))[-1]["finish_reason"] == "length"
    ids = {"session": first["session"], "token": first["token"]}
    session_keys = client_redis.keys(f"*{first['session']}*")
    assert session_keys and all(0 < client_redis.ttl(k) <= TTL for k in session_keys)

    await asyncio.sleep(TTL + 1.5)
    await client.send(type="resume", id="r", **ids)
    assert (await client.recv())["code"] == "not_found"
    await client.send(type="generate", id="g", prompt=" again", params=SHORT, **ids)
    refused = await client.recv()
    assert (refused["code"], refused["id"]) == ("not_found", "g")
    await client.close()

    # A frontend killed without a chance to clean up, an engine stopped cleanly.
    frontend.send_signal(signal.SIGKILL)
    frontend.wait()
    engine.send_signal(signal.SIGTERM)
    engine.wait(30)
    assert keys_without_expiry(client_redis) == []
