"""SIGTERM to an engine: it stops taking turns, finishes what it can within
its grace period, and hands the rest to another engine at once, long before
the lease would have run out. The client sees the uninterrupted text."""

from __future__ import annotations

import signal
import time
from collections.abc import AsyncIterator

import pytest
import redis

from tests.stack import Client, Stack, joined, start_frontend
from wsinfer.server import Frontend
from wsinfer.sessions import keys

PROMPT = [{"role": "user", "content": "Write a very long poem about the sea."}]
GREEDY = {"temperature": 0, "max_new_tokens": 400}
LONG_LEASE = ("--lease-ms", "120000")  # a takeover by lease expiry would take 2 minutes


@pytest.fixture
async def frontend(redis_url: str) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(redis_url)
    yield frontend
    await frontend.stop()


async def test_sigterm_hands_running_turns_over_at_once(
    stack: Stack, frontend: Frontend, redis_client: redis.Redis
) -> None:
    engines = {
        # No grace: the tiny model could finish the turn in half a second.
        name: stack.start_engine(name, *LONG_LEASE, "--drain-grace", "0")
        for name in ("engine-a", "engine-b")
    }
    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    reference, _ = joined(await client.until("done"))

    await client.send(type="generate", messages=PROMPT, params=GREEDY)
    session = (await client.recv())["session"]
    head = [await client.recv() for _ in range(3)]
    owner = engines[redis_client.hget(keys.meta(session), "engine").decode()]
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(30) == 0
    started = time.monotonic()
    text, _ = joined(head + await client.until("done", timeout=100))
    await client.close()
    assert text == reference
    assert time.monotonic() - started < 60, "handed over by the lease, not by the drain"
    assert int(redis_client.hget(keys.meta(session), "epoch") or 0) >= 2


async def test_sigterm_lets_a_short_turn_finish_and_takes_no_new_one(
    stack: Stack, frontend: Frontend, redis_client: redis.Redis
) -> None:
    first = stack.start_engine("engine-a", *LONG_LEASE, "--drain-grace", "60")
    client = await Client.open(frontend.port)
    await client.send(type="generate", messages=PROMPT, params={"max_new_tokens": 60})
    session = (await client.recv())["session"]
    await client.recv()
    first.send_signal(signal.SIGTERM)
    messages = await client.until("done")
    assert first.wait(30) == 0  # exits once its last turn is done
    assert messages[-1]["finish_reason"] in ("stop", "length")
    assert int(redis_client.hget(keys.meta(session), "epoch") or 0) == 1  # never handed over
    assert not redis_client.zscore(keys.ENGINES, "engine-a")  # deregistered: no new work
    await client.close()
