"""A turn's control flag, from a client's stop or pause to the engine running
it: what the CONTROL script writes is a ``schema.Control`` the engine reads,
by polling and in each publish's reply (engine/process.py acts on it)."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio as aioredis

from wsinfer.sessions.schema import Control, DeltaEvent, GenerationParams
from wsinfer.sessions.store import SessionStore, TurnInput
from wsinfer.sessions.worker import ClaimedTurn, Publish, WorkerStore

CHAT = TurnInput("chat", [{"role": "user", "content": "hi"}], None, GenerationParams())


@pytest.fixture
def store(aredis: aioredis.Redis) -> SessionStore:
    return SessionStore(aredis, ttl_s=60)


@pytest.fixture
def worker(redis_client: redis.Redis) -> WorkerStore:
    w = WorkerStore(redis_client, "engine-a", ttl_s=60)
    w.ensure_group()
    return w


def _claim(worker: WorkerStore) -> ClaimedTurn:
    items = worker.read_work(10, None)
    claimed = worker.claim(items[-1].request, takeover=False)
    assert claimed is not None
    return claimed


@pytest.mark.parametrize("action", ["stop", "pause"])
async def test_a_clients_ask_reaches_the_engine_as_its_flag(
    store: SessionStore, worker: WorkerStore, action: str
) -> None:
    session, token = await store.create(CHAT)
    claimed = _claim(worker)
    assert claimed.control is Control.NONE
    assert worker.poll([(session, 1)])[(session, 1)][0] is Control.NONE
    await store.control(session, token, 1, action)
    flag = Control(action)
    assert worker.poll([(session, 1)])[(session, 1)][0] is flag
    delta = Publish(session, 1, claimed.epoch, 1, [DeltaEvent(1, "a", [7])])
    assert worker.publish_many([delta])[0].control is flag


def test_a_flag_this_version_does_not_know_asks_nothing() -> None:
    assert Control.of("stop") is Control.STOP and Control.of("pause") is Control.PAUSE
    assert Control.of("") is Control.NONE and Control.of("rewind") is Control.NONE
