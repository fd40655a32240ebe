"""A repeated ``generate`` with one idempotency key starts one turn (real Redis).

A client whose connection dropped before the ``session`` answer re-sends the
generate with the same key: it gets the same session, token and turn, however
the two requests interleave, and whichever frontend each reaches.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from tests.stack import Client
from tests.wsinfer.test_server_e2e import start_frontend
from wsinfer.server import Frontend
from wsinfer.sessions import keys
from wsinfer.sessions.schema import GenerationParams
from wsinfer.sessions.states import IllegalTransition
from wsinfer.sessions.store import SessionStore, TurnInput

PROMPT = TurnInput("chat", [{"role": "user", "content": "hi"}], None, GenerationParams())


def new_key() -> str:
    return secrets.token_hex(16)


async def turns_queued(aredis: aioredis.Redis, session: str) -> int:
    """Work items naming the session (a repeat's stray item is refused at claim,
    but none should name a turn that does not exist)."""
    entries = await aredis.xrange(keys.REQUESTS)
    return sum(session.encode() in b"".join(fields.values()) for _, fields in entries)


async def test_two_generates_with_one_key_make_one_session(aredis: aioredis.Redis) -> None:
    store = SessionStore(aredis)
    key = new_key()
    first = await store.create_once(PROMPT, key)
    again = await store.create_once(PROMPT, key)
    assert (first.repeat, again.repeat) == (False, True)
    assert (again.session, again.token, again.turn, again.status) == (
        first.session,
        first.token,
        1,
        "queued",
    )
    info = await store.info(first.session, first.token)
    assert info.turn == 1
    other = await store.create_once(PROMPT, new_key())
    assert other.session != first.session and other.token != first.token


async def test_a_turn_added_with_a_key_is_added_once(aredis: aioredis.Redis) -> None:
    store = SessionStore(aredis)
    session, token = await store.create(PROMPT)
    await aredis.hset(keys.meta(session), "status", "done")
    key, alive = new_key(), frozenset[str]()
    first = await store.add_turn_once(session, token, PROMPT, key, alive)
    again = await store.add_turn_once(session, token, PROMPT, key, alive)
    assert (first.turn, first.repeat, again.turn, again.repeat) == (2, False, 2, True)
    assert again.status == "queued" and (await store.info(session, token)).turn == 2
    with pytest.raises(IllegalTransition):  # another key is another turn: one at a time
        await store.add_turn_once(session, token, PROMPT, new_key(), alive)
    await aredis.hset(keys.meta(session), "status", "done")
    third = await store.add_turn_once(session, token, PROMPT, new_key(), alive)
    late = await store.add_turn_once(session, token, PROMPT, key, alive)
    assert third.turn == 3 and (late.turn, late.status, late.repeat) == (2, "done", True)


@pytest.mark.parametrize("new_session", [True, False])
async def test_a_race_of_two_with_one_key_starts_one_turn(
    redis_url: str, aredis: aioredis.Redis, new_session: bool
) -> None:
    """Two frontends (two connections to Redis) at once: one starts, one repeats."""
    a, b = aioredis.from_url(redis_url), aioredis.from_url(redis_url)
    store_a, store_b = SessionStore(a), SessionStore(b)
    try:
        for _ in range(20):
            key = new_key()
            if new_session:
                pair = await asyncio.gather(
                    store_a.create_once(PROMPT, key), store_b.create_once(PROMPT, key)
                )
            else:
                session, token = await store_a.create(PROMPT)
                await aredis.hset(keys.meta(session), "status", "done")
                pair = await asyncio.gather(
                    store_a.add_turn_once(session, token, PROMPT, key, frozenset()),
                    store_b.add_turn_once(session, token, PROMPT, key, frozenset()),
                )
            one, two = pair
            assert sorted([one.repeat, two.repeat]) == [False, True]
            assert (one.session, one.token, one.turn) == (two.session, two.token, two.turn)
            assert (await store_a.info(one.session, one.token)).turn == one.turn
    finally:
        await a.aclose()
        await b.aclose()


@pytest.fixture
async def frontend(redis_url: str, aredis: aioredis.Redis) -> AsyncIterator[Frontend]:
    """A frontend that believes an engine is alive (turns stay queued)."""
    await aredis.zadd(keys.ENGINES, {"engine-stub": time.time() + 3600})
    frontend = await start_frontend(redis_url)
    yield frontend
    await frontend.stop()


async def test_a_generate_resent_on_a_new_connection_rejoins_its_turn(
    frontend: Frontend, aredis: aioredis.Redis
) -> None:
    key = new_key()
    request = {"type": "generate", "prompt": "Once", "idempotency_key": key}
    lost = await Client.open(frontend.port)
    await lost.send(id=1, **request)
    first = await lost.recv()
    lost.ws.transport.abort()  # as if this answer never arrived
    again = await Client.open(frontend.port)
    await again.send(id=2, **request)
    answer = await again.recv()
    assert answer == {**first, "id": 2}
    assert first["status"] == "queued" and first["turn"] == 1
    # It follows the turn it rejoined: a stop from it is seen through to `done`.
    await again.send(type="stop", session=first["session"], token=first["token"])
    done = await again.until("done", timeout=10)
    assert done[-1]["finish_reason"] == "cancelled"
    await again.close()
    assert await turns_queued(aredis, first["session"]) >= 1
    assert (await SessionStore(aredis).info(first["session"], first["token"])).turn == 1
