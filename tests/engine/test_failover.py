"""Engine failover with real processes: kill -9 the engine running a turn; the
other engine takes it over from the token log once its lease expires, and the
client sees the same text as an uninterrupted run, with no gap or repeat."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis

from tests.stack import Client, Stack, joined, start_frontend
from wsinfer.server import Frontend
from wsinfer.sessions import keys

PROMPT = [{"role": "user", "content": "Write a very long poem about the sea."}]
GREEDY = {"temperature": 0, "max_new_tokens": 400}


@pytest.fixture
async def frontend(redis_url: str) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(redis_url)
    yield frontend
    await frontend.stop()


async def full_text(port: int, params: dict[str, object]) -> str:
    client = await Client.open(port)
    await client.send(type="generate", messages=PROMPT, params=params)
    text, _ = joined(await client.until("done"))
    await client.close()
    return text


@pytest.mark.parametrize("params", [GREEDY, {**GREEDY, "temperature": 0.8, "seed": 7}])
async def test_kill_9_mid_turn_is_invisible_to_the_client(
    stack: Stack, frontend: Frontend, redis_client: redis.Redis, params: dict[str, object]
) -> None:
    engines = {name: stack.start_engine(name) for name in ("engine-a", "engine-b")}
    reference = await full_text(frontend.port, params)

    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params=params)
    session = (await client.recv())["session"]
    messages = [await client.recv() for _ in range(3)]
    owner = redis_client.hget(keys.meta(session), "engine")
    assert owner, "the turn should be running on an engine"
    victim = engines[owner.decode()]
    victim.kill()  # SIGKILL: no cleanup, no goodbye
    killed_at = joined(messages)[1]
    messages += await client.until("done", timeout=180)
    text, seq = joined(messages)
    await client.close()

    assert victim.wait() == -9
    survivor = redis_client.hget(keys.meta(session), "epoch")
    assert int(survivor or 0) >= 2, "the turn was not taken over"
    assert seq > killed_at
    assert text == reference


async def test_a_turn_finishes_when_its_only_engine_restarts(
    stack: Stack, frontend: Frontend
) -> None:
    first = stack.start_engine("engine-a")
    reference = await full_text(frontend.port, GREEDY)
    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    await client.recv()
    head = [await client.recv() for _ in range(2)]
    first.kill()
    assert await asyncio.to_thread(first.wait, 10) == -9  # gone before its successor starts
    stack.start_engine("engine-a2")
    text, _ = joined(head + await client.until("done", timeout=180))
    await client.close()
    assert text == reference


async def test_next_turns_land_on_the_engine_with_the_cache(
    stack: Stack, frontend: Frontend, redis_client: redis.Redis
) -> None:
    for name in ("engine-a", "engine-b"):
        stack.start_engine(name)
    client = await Client.open(frontend.port)
    for _ in range(4):
        await client.send(type="generate", messages=PROMPT, params={"max_new_tokens": 20})
        turn1 = await client.until("done")
        ids = {"session": turn1[0]["session"], "token": turn1[0]["token"]}
        holder = redis_client.hget(keys.meta(ids["session"]), "kv_engine")
        await client.send(type="generate", messages=PROMPT, params={"max_new_tokens": 5}, **ids)
        turn2 = await client.until("done")
        assert redis_client.hget(keys.meta(ids["session"]), "kv_engine") == holder
        # The whole first prompt is reused, but for its last token at most: the
        # conversation is rendered again, and a reply that starts with a space
        # or a newline may merge with the generation prompt's final newline.
        assert turn2[-1]["usage"]["cached_tokens"] >= turn1[-1]["usage"]["prompt_tokens"] - 1
    await client.close()
