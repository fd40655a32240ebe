"""Session state against a real Redis: every transition of states.TRANSITIONS,
fencing, takeover, and the failure answers (not_found, conflict, mode)."""

from __future__ import annotations

import time

import pytest
import redis
import redis.asyncio as aioredis

from wsinfer.clock import ManualClock
from wsinfer.sessions import keys
from wsinfer.sessions.schema import (
    ENGINE_FRESH_S,
    DeltaEvent,
    DoneEvent,
    GenerationParams,
    PausedEvent,
    Usage,
)
from wsinfer.sessions.states import IllegalTransition
from wsinfer.sessions.store import (
    CLOSE_LINGER_S,
    ModeMismatch,
    SessionNotFound,
    SessionStore,
    TurnInput,
)
from wsinfer.sessions.worker import Publish, WorkerStore

CHAT = TurnInput("chat", [{"role": "user", "content": "hi"}], None, GenerationParams())
TEXT = TurnInput("text", None, "Once upon", GenerationParams(temperature=0))


@pytest.fixture
def store(aredis: aioredis.Redis) -> SessionStore:
    return SessionStore(aredis, ttl_s=60)


@pytest.fixture
def clock() -> ManualClock:
    """The time a test moves; it starts at the real time, so what the scripts keep
    (``seen_at``, a turn's creation) stays plausible."""
    return ManualClock(time.time())


@pytest.fixture
def worker(redis_client: redis.Redis) -> WorkerStore:
    w = WorkerStore(redis_client, "engine-a", ttl_s=60)
    w.ensure_group()
    return w


def _claim_next(worker: WorkerStore, takeover: bool = False):  # type: ignore[no-untyped-def]
    items = worker.read_work(10, None)
    assert items, "nothing queued"
    return items[-1], worker.claim(items[-1].request, takeover=takeover)


async def test_create_queues_work_and_hides_the_token(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    session, token = await store.create(CHAT)
    info = await store.info(session, token)
    assert (info.turn, info.status, info.seq) == (1, "queued", 0)
    assert token.encode() not in redis_client.hget(keys.meta(session), "token")
    item, claimed = _claim_next(worker)
    assert item.request.session == session and claimed is not None
    assert claimed.epoch == 1 and claimed.meta.status == "running"


async def test_wrong_token_and_unknown_session_are_not_found(store: SessionStore) -> None:
    session, _ = await store.create(CHAT)
    with pytest.raises(SessionNotFound):
        await store.info(session, "wrong")
    with pytest.raises(SessionNotFound):
        await store.add_turn("nope", "nope", CHAT)
    with pytest.raises(SessionNotFound):
        await store.control(session, "wrong", 1, "stop")
    with pytest.raises(SessionNotFound):
        await store.close(session, "wrong")


async def test_generate_during_a_turn_is_a_conflict(store: SessionStore) -> None:
    session, token = await store.create(CHAT)
    with pytest.raises(IllegalTransition):
        await store.add_turn(session, token, CHAT)


async def test_mode_cannot_change_within_a_session(
    store: SessionStore, worker: WorkerStore
) -> None:
    session, token = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    worker.publish_many([Publish(session, 1, claimed.epoch, 0, [DoneEvent(0, "stop")])])
    with pytest.raises(ModeMismatch):
        await store.add_turn(session, token, TEXT)
    assert await store.add_turn(session, token, CHAT) == 2


async def test_stop_of_a_queued_turn_finishes_it_without_an_engine(
    store: SessionStore, worker: WorkerStore
) -> None:
    session, token = await store.create(CHAT)
    result = await store.control(session, token, 1, "stop")
    assert (result.effect, result.status) == ("done_cancelled", "done")
    events, _ = await store.read_turn(session, 1)
    assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "cancelled"
    item = worker.read_work(10, None)[0]
    assert worker.claim(item.request, takeover=False) is None  # stale work is skipped


async def test_pause_resume_of_a_running_turn(store: SessionStore, worker: WorkerStore) -> None:
    session, token = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    result = await store.control(session, token, 1, "pause")
    assert result.effect == "control:pause" and result.status == "running"
    events = [DeltaEvent(3, "abc", [1, 2, 3]), PausedEvent(3)]
    stopped = DoneEvent(3, "cancelled", Usage(0, 3))
    outcome = worker.publish_many(
        [Publish(session, 1, claimed.epoch, 3, events, if_stopped=stopped)]
    )
    assert outcome[0].outcome == "ok" and outcome[0].control == ""
    assert (await store.info(session, token)).status == "paused"
    resumed = await store.control(session, token, 1, "resume")
    assert resumed.effect == "requeue" and resumed.status == "queued"
    _, again = _claim_next(worker)
    assert again is not None and again.epoch == 2
    assert worker.read_generated(session, 1) == ([1, 2, 3], 3)


async def test_resume_of_a_running_turn_is_illegal(
    store: SessionStore, worker: WorkerStore
) -> None:
    session, token = await store.create(CHAT)
    _claim_next(worker)
    with pytest.raises(IllegalTransition) as info:
        await store.control(session, token, 1, "resume")
    assert info.value.current == "running"


async def test_takeover_fences_the_previous_engine(
    store: SessionStore, redis_client: redis.Redis, worker: WorkerStore
) -> None:
    session, _ = await store.create(CHAT)
    _, first = _claim_next(worker)
    worker.publish_many([Publish(session, 1, first.epoch, 1, [DeltaEvent(1, "a", [7])])])
    other = WorkerStore(redis_client, "engine-b", ttl_s=60)
    taken = other.take_over_expired(min_idle_ms=0, count=10)
    assert [t.request.session for t in taken] == [session]
    second = other.claim(taken[0].request, takeover=True)
    assert second is not None and second.epoch == first.epoch + 1
    late = worker.publish_many([Publish(session, 1, first.epoch, 2, [DeltaEvent(2, "b", [8])])])
    assert late[0].outcome == "fenced"
    ok = other.publish_many([Publish(session, 1, second.epoch, 2, [DeltaEvent(2, "b", [8])])])
    assert ok[0].outcome == "ok"
    assert worker.read_generated(session, 1) == ([7, 8], 2)


async def test_leases_renewed_are_not_taken_over(
    store: SessionStore, redis_client: redis.Redis, worker: WorkerStore
) -> None:
    await store.create(CHAT)
    item, _ = _claim_next(worker)
    time.sleep(0.3)  # the entry has been idle longer than the lease below...
    worker.renew_leases([item])  # ...until its engine renews it
    other = WorkerStore(redis_client, "engine-b")
    assert other.take_over_expired(min_idle_ms=200, count=10) == []


async def test_close_deletes_everything_and_the_engine_notices(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    session, token = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    worker.publish_many([Publish(session, 1, claimed.epoch, 1, [DeltaEvent(1, "a", [7])])])
    await store.close(session, token)
    # Only the running turn's stream stays, briefly, ending in a cancelled done
    # for followers on other connections.
    stream = keys.turn_stream(session, 1)
    assert redis_client.keys(f"*{session}*") == [stream.encode()]
    assert 0 < redis_client.ttl(stream) <= CLOSE_LINGER_S
    events, _ = await store.read_turn(session, 1)
    assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "cancelled"
    assert events[-1].seq == 1
    with pytest.raises(SessionNotFound):
        await store.info(session, token)
    assert worker.poll([(session, 1)]) == {}
    gone = worker.publish_many([Publish(session, 1, claimed.epoch, 2, [DeltaEvent(2, "b", [8])])])
    assert gone[0].outcome == "not_found"


async def test_history_rebuilds_chat_and_text_sessions(
    store: SessionStore, worker: WorkerStore
) -> None:
    session, token = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    worker.save_prompt(claimed, [5, 6])
    worker.publish_many(
        [
            Publish(
                session,
                1,
                claimed.epoch,
                2,
                [
                    DeltaEvent(1, "Hel", [1]),
                    DeltaEvent(2, "lo", [2]),
                    DoneEvent(2, "stop", Usage(2, 2)),
                ],
            )
        ]
    )
    await store.add_turn(
        session,
        token,
        TurnInput("chat", [{"role": "user", "content": "again"}], None, GenerationParams()),
    )
    history = worker.load_history(session, 2)
    assert history.chat_turns == [([{"role": "user", "content": "hi"}], "Hello")]
    assert history.current.messages == [{"role": "user", "content": "again"}]

    text_session, text_token = await store.create(TEXT)
    _, claimed = _claim_next(worker)
    worker.save_prompt(claimed, [9])
    worker.publish_many(
        [
            Publish(
                text_session,
                1,
                claimed.epoch,
                1,
                [DeltaEvent(1, "x", [10]), DoneEvent(1, "length")],
            )
        ]
    )
    await store.add_turn(text_session, text_token, TEXT)
    assert worker.load_history(text_session, 2).previous_ids == [9, 10]


async def test_touch_marks_sessions_watched_and_extends_ttl(
    store: SessionStore, redis_client: redis.Redis
) -> None:
    session, _ = await store.create(CHAT)
    redis_client.hset(keys.meta(session), "seen_at", 0)
    redis_client.expire(keys.meta(session), 5)
    redis_client.expire(keys.turn_input(session, 1), 5)
    await store.touch({session: 1})
    assert redis_client.ttl(keys.meta(session)) > 5
    assert redis_client.ttl(keys.turn_input(session, 1)) > 5
    assert float(redis_client.hget(keys.meta(session), "seen_at")) > time.time() - 5


async def test_a_turn_kept_running_stays_watched_under_touches_and_controls(
    store: SessionStore, redis_client: redis.Redis
) -> None:
    """A background turn: watched until now + ttl, whoever touches or resumes it
    meanwhile; the next turn is watched as any other again."""
    session, token = await store.create(CHAT)
    await store.keep_running(session, token, 1)
    until = float(redis_client.hget(keys.meta(session), "seen_at"))
    assert until > time.time() + 50  # the store's ttl is 60 s
    await store.touch({session: 1})
    await store.control(session, token, 1, "pause")
    assert float(redis_client.hget(keys.meta(session), "seen_at")) == until
    with pytest.raises(SessionNotFound):
        await store.keep_running(session, "wrong", 1)
    with pytest.raises(IllegalTransition):
        await store.keep_running(session, token, 2)
    await store.control(session, token, 1, "stop")  # paused --stop--> done
    await store.add_turn(session, token, CHAT)
    assert float(redis_client.hget(keys.meta(session), "seen_at")) < time.time() + 1


async def test_a_turn_records_when_it_started_and_its_input(store: SessionStore) -> None:
    before = int(time.time())
    session, _ = await store.create(CHAT)
    created, turn_input = await store.turn_record(session, 1)
    assert before <= created <= time.time() and turn_input == CHAT
    assert await store.turn_created(session, 1) == created
    assert await store.turn_record(session, 2) == (0, None)


async def test_touch_does_not_bring_back_a_closed_session(
    store: SessionStore, redis_client: redis.Redis
) -> None:
    session, token = await store.create(CHAT)
    await store.close(session, token)
    # A follower on another connection, a moment late: told the session is gone.
    assert (await store.touch({session: 1})).gone == [session]
    lingering = keys.turn_stream(session, 1)
    assert not redis_client.exists(*[k for k in keys.session_keys(session, 1) if k != lingering])
    assert 0 < redis_client.ttl(lingering) <= CLOSE_LINGER_S


async def test_a_stop_that_meets_the_engines_pause_still_cancels_the_turn(
    store: SessionStore, worker: WorkerStore
) -> None:
    # The engine decided to pause (idle) before it saw the client's stop flag.
    session, token = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    assert (await store.control(session, token, 1, "stop")).effect == "control:stop"
    worker.publish_many(
        [
            Publish(
                session,
                1,
                claimed.epoch,
                2,
                [DeltaEvent(2, "ab", [1, 2]), PausedEvent(2)],
                {"prompt_tokens": 7, "cached_tokens": 5},
                if_stopped=DoneEvent(2, "cancelled", Usage(7, 2, 5)),
            )
        ]
    )
    assert (await store.info(session, token)).status == "done"
    events, _ = await store.read_turn(session, 1)
    assert [type(e) for e in events] == [DeltaEvent, DoneEvent]  # no stale paused
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled"
    assert (done.seq, done.usage) == (2, Usage(7, 2, 5))
    assert await store.add_turn(session, token, CHAT) == 2  # the session moves on


async def test_an_engine_pause_without_a_pending_stop_stays_paused(
    store: SessionStore, worker: WorkerStore
) -> None:
    session, token = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    await store.control(session, token, 1, "pause")
    stopped = DoneEvent(1, "cancelled", Usage(0, 1))
    worker.publish_many(
        [Publish(session, 1, claimed.epoch, 1, [PausedEvent(1)], if_stopped=stopped)]
    )
    assert (await store.info(session, token)).status == "paused"
    events, _ = await store.read_turn(session, 1)
    assert events == [PausedEvent(1)]


async def test_resume_marks_the_session_watched(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    # Else the engine that claims the resumed turn finds it idle and pauses it again.
    session, token = await store.create(CHAT)
    await store.control(session, token, 1, "pause")
    redis_client.hset(keys.meta(session), "seen_at", 0)
    await store.control(session, token, 1, "resume")
    assert float(redis_client.hget(keys.meta(session), "seen_at")) > time.time() - 5


async def test_engines_alive_and_queue_depth(store: SessionStore, worker: WorkerStore) -> None:
    assert await store.engines_alive(5) == 0
    assert worker.heartbeat() == 0  # no queue yet
    assert await store.engines_alive(5) == 1
    await store.create(CHAT)
    await store.create(CHAT)
    assert await store.queue_depth() == 2
    assert worker.heartbeat() == 2  # the engine's view of the backlog
    worker.read_work(1, None)
    assert await store.queue_depth() == 1
    assert worker.heartbeat() == 1


async def _finish_turn(worker: WorkerStore, session: str, kv: bool) -> None:
    _, claimed = _claim_next(worker)
    fields = {"kv_engine": worker.engine_id if kv else "", "kv_len": 5 if kv else 0}
    worker.publish_many(
        [Publish(session, claimed.turn, claimed.epoch, 1, [DoneEvent(1, "stop")], fields)]
    )


async def test_next_turn_goes_to_the_engine_holding_the_kv_cache(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    other = WorkerStore(redis_client, "engine-b")
    other.ensure_group()
    worker.heartbeat()
    other.heartbeat()
    session, token = await store.create(CHAT)
    await _finish_turn(worker, session, kv=True)
    await store.add_turn(session, token, CHAT)
    assert other.read_work(10, None) == []  # not on the shared queue
    item = worker.read_work(10, None)[0]
    assert item.stream == keys.engine_requests("engine-a") and item.request.turn == 2


async def test_a_dead_engines_own_queue_is_drained_by_the_others(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    worker.heartbeat()
    session, token = await store.create(CHAT)
    await _finish_turn(worker, session, kv=True)
    await store.add_turn(session, token, CHAT)  # routed to engine-a ...
    worker.deregister()  # ... which then stops before reading it
    other = WorkerStore(redis_client, "engine-b")
    other.ensure_group()
    taken = other.take_over_expired(min_idle_ms=1000, count=10)
    assert [(t.request.session, t.request.turn) for t in taken] == [(session, 2)]
    claimed = other.claim(taken[0].request, takeover=True)
    assert claimed is not None
    other.ack(taken[0])
    assert other.take_over_expired(min_idle_ms=1000, count=10) == []
    assert redis_client.zscore(keys.ENGINES, "engine-a") is None  # forgotten once drained


async def test_an_engine_is_dead_to_the_others_once_silent_by_their_clock(
    aredis: aioredis.Redis, redis_client: redis.Redis
) -> None:
    """Far from the real time: workers that read ``time.time`` would never see
    the heartbeat go stale (or would see it stale at once)."""
    clock = ManualClock()
    store = SessionStore(aredis, ttl_s=60, clock=clock)
    silent, other = (WorkerStore(redis_client, e, ttl_s=60, clock=clock) for e in "ab")
    silent.ensure_group()
    silent.heartbeat()
    assert redis_client.zscore(keys.ENGINES, "a") == clock()
    session, token = await store.create(CHAT)
    await _finish_turn(silent, session, kv=True)
    assert int(redis_client.hget(keys.meta(session), "claimed_at")) == int(clock())
    await store.add_turn(session, token, CHAT)  # routed to the engine holding the cache
    clock.advance(59)
    assert other.take_over_expired(min_idle_ms=60_000, count=10) == []  # heard from 59 s ago
    clock.advance(2)
    taken = other.take_over_expired(min_idle_ms=60_000, count=10)
    assert [(t.request.session, t.request.turn) for t in taken] == [(session, 2)]


async def test_no_routing_to_a_silent_engine(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    session, token = await store.create(CHAT)
    await _finish_turn(worker, session, kv=True)
    redis_client.zadd(keys.ENGINES, {"engine-a": 1.0})  # last heard of long ago
    await store.add_turn(session, token, CHAT)
    assert redis_client.xlen(keys.engine_requests("engine-a")) == 0
    assert worker.read_work(10, None)[0].stream == keys.REQUESTS


async def test_the_store_judges_an_engine_alive_by_its_own_clock(
    aredis: aioredis.Redis, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    """Far from the real time: a store that read ``time.time`` would see no engine."""
    clock = ManualClock()
    store = SessionStore(aredis, ttl_s=60, clock=clock)
    session, token = await store.create(CHAT)
    await _finish_turn(worker, session, kv=True)
    redis_client.zadd(keys.ENGINES, {"engine-a": clock()})  # its heartbeat, as of now
    clock.advance(ENGINE_FRESH_S - 1)
    assert await store.engines_alive(ENGINE_FRESH_S) == 1
    assert (await store.capacity(ENGINE_FRESH_S)).alive == {"engine-a"}
    await store.add_turn(session, token, CHAT)  # to the engine holding the KV cache
    assert redis_client.xlen(keys.engine_requests("engine-a")) == 1
    await _finish_turn(worker, session, kv=True)
    clock.advance(2)  # its heartbeat is older than ENGINE_FRESH_S: stale
    assert await store.engines_alive(ENGINE_FRESH_S) == 0
    await store.add_turn(session, token, CHAT)
    assert redis_client.xlen(keys.engine_requests("engine-a")) == 1
    assert worker.read_work(10, None)[0].stream == keys.REQUESTS


async def test_a_cleanly_stopped_engine_with_no_work_leaves_no_keys(
    worker: WorkerStore, redis_client: redis.Redis
) -> None:
    worker.heartbeat()
    for key in (keys.ENGINES, keys.REQUESTS, worker.own_queue):
        assert 0 < redis_client.ttl(key) <= 60  # shared keys live only while engines do
    worker.deregister()
    assert redis_client.zscore(keys.ENGINES, "engine-a") is None
    assert not redis_client.exists(worker.own_queue)


async def test_a_publish_retried_after_a_lost_reply_is_not_applied_twice(
    store: SessionStore, worker: WorkerStore
) -> None:
    session, _ = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    step = Publish(session, 1, claimed.epoch, 1, [DeltaEvent(1, "a", [7])], {"pub": 1})
    assert worker.publish_many([step])[0].outcome == "ok"
    assert worker.publish_many([step])[0].outcome == "ok"  # the retry
    assert worker.read_generated(session, 1) == ([7], 1)
    done = Publish(session, 1, claimed.epoch, 1, [DoneEvent(1, "stop", Usage())], {"pub": 2})
    assert worker.publish_many([done])[0].outcome == "ok"
    assert worker.publish_many([done])[0].outcome == "ok"  # not fenced: the same publish
    events, _ = await store.read_turn(session, 1)
    assert [type(e).__name__ for e in events] == ["DeltaEvent", "DoneEvent"]


async def test_release_requeues_a_running_turn_for_any_engine(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    session, token = await store.create(TEXT)
    item, claimed = _claim_next(worker)
    worker.publish_many([Publish(session, 1, claimed.epoch, 1, [DeltaEvent(1, "a", [7])])])
    worker.release([(item, claimed.epoch)])
    info = await store.info(session, token)
    assert (info.status, info.engine, info.seq) == ("queued", "", 1)
    other = WorkerStore(redis_client, "engine-b", ttl_s=60)
    other.ensure_group()
    again, reclaimed = _claim_next(other)  # a plain claim: no lease had to run out
    assert reclaimed is not None and reclaimed.epoch == claimed.epoch + 1
    assert other.read_generated(session, 1) == ([7], 1)
    # The first engine's entry was acked; a stale release is fenced and acks nothing.
    assert redis_client.xpending(keys.REQUESTS, keys.ENGINE_GROUP)["pending"] == 1
    worker.release([(again, claimed.epoch)])
    assert redis_client.xpending(keys.REQUESTS, keys.ENGINE_GROUP)["pending"] == 1
    assert (await store.info(session, token)).status == "running"


async def test_a_session_keeps_the_ttl_it_was_created_with(
    aredis: aioredis.Redis, redis_client: redis.Redis
) -> None:
    # The engine's and another frontend's own settings (the default hour) must
    # not stretch a 60 s session: every write renews it with its own TTL.
    store = SessionStore(aredis, ttl_s=60)
    session, token = await store.create(CHAT)
    engine = WorkerStore(redis_client, "engine-a")
    engine.ensure_group()
    _, claimed = _claim_next(engine)
    engine.save_prompt(claimed, [5, 6])
    delta = Publish(session, 1, claimed.epoch, 1, [DeltaEvent(1, "a", [7])])
    assert engine.publish_many([delta])[0].outcome == "ok"
    await SessionStore(aredis).touch({session: 1})
    await SessionStore(aredis).control(session, token, 1, "stop")
    ttls = [redis_client.ttl(key) for key in redis_client.keys(f"*{session}*")]
    assert len(ttls) == 4 and all(0 < ttl <= 60 for ttl in ttls)


async def test_a_stop_or_close_retries_when_the_engine_moved_on(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    # The cancelled done is encoded from the meta read just before the
    # script: counters changed in between make the script refuse, and the
    # store reads again, so the done never carries a stale seq.
    session, token = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    worker.publish_many([Publish(session, 1, claimed.epoch, 2, [DeltaEvent(2, "ab", [1, 2])])])
    read = store.info

    async def racing_info(session: str, token: str):  # type: ignore[no-untyped-def]
        info = await read(session, token)
        if info.seq == 2:  # the engine publishes right after this read
            more = Publish(session, 1, claimed.epoch, 3, [DeltaEvent(3, "c", [3])])
            worker.publish_many([more])
        return info

    store.info = racing_info  # type: ignore[method-assign]
    await store.close(session, token)
    events, _ = await store.read_turn(session, 1)
    assert [e.seq for e in events] == [2, 3, 3] and isinstance(events[-1], DoneEvent)
    assert events[-1].usage.completion_tokens == 3


def test_the_scripts_use_only_the_meta_fields_of_the_record() -> None:
    import re

    from wsinfer.sessions import scripts
    from wsinfer.sessions.schema import SessionMeta

    lua = "".join(v for k, v in vars(scripts).items() if k.isupper() and isinstance(v, str))
    named = set(re.findall(r"'(\w+)'", lua)) - _LUA_WORDS
    assert named <= set(SessionMeta.__dataclass_fields__), named - set(
        SessionMeta.__dataclass_fields__
    )
    # Events come encoded by schema.pack and stay opaque: msgpack is only
    # PUBLISH's envelope of a step's turns (and of its replies).
    assert re.findall(r"cmsgpack\.\w+\([^)]*\)", lua) == [
        "cmsgpack.unpack(ARGV[4])",
        "cmsgpack.pack(replies)",
    ]


_LUA_WORDS = {
    "HGET", "HMGET", "HSET", "HINCRBY", "HGETALL", "HDEL", "EXISTS", "EXPIRE", "DEL", "SET", "EX",
    "XADD", "SPUBLISH", "TIME", "ok", "not_found", "illegal", "stale", "fenced", "gap", "moved",
    "mode", "exists", "new", "done", "stop", "repeat", "m", "control:", "done_cancelled", "paused",
    "requeue", "1",
}  # fmt: skip


async def test_a_running_turn_renews_its_expiry_every_sixteenth_of_the_ttl(
    aredis: aioredis.Redis, redis_client: redis.Redis
) -> None:
    """Not on every delta (two EXPIREs per delta were a quarter of the publish
    script), yet the keys always live at least the TTL after each write."""
    store = SessionStore(aredis, ttl_s=160)  # renewed every 10 s, to 170 s
    session, _ = await store.create(CHAT)
    worker = WorkerStore(redis_client, "engine-a", ttl_s=160)
    worker.ensure_group()
    _, claimed = _claim_next(worker)
    meta, stream = keys.meta(session), keys.turn_stream(session, 1)

    def publish(seq: int, pub: int, final: bool = False) -> None:
        events: list = [DeltaEvent(seq, "a", [seq])]
        if final:
            events.append(DoneEvent(seq, "length", Usage(1, seq)))
        item = Publish(session, 1, claimed.epoch, seq, events, {"pub": pub}, seq - 1)
        assert worker.publish_many([item])[0].outcome == "ok"

    def ttls() -> list[int]:
        return [redis_client.ttl(meta), redis_client.ttl(stream)]

    publish(1, 1)  # a claim's first publish renews: the stream is new
    assert all(160 < ttl <= 170 for ttl in ttls()), ttls()
    redis_client.expire(meta, 100)  # as if 70 s went by without a renewal
    redis_client.expire(stream, 100)
    publish(2, 2)  # renewed less than 10 s ago: no EXPIRE
    assert all(ttl <= 100 for ttl in ttls()), ttls()
    redis_client.hset(meta, "renewed_at", int(redis_client.time()[0]) - 10)
    publish(3, 3)
    assert all(160 < ttl <= 170 for ttl in ttls()), ttls()
    redis_client.expire(meta, 100)
    redis_client.expire(stream, 100)
    publish(4, 4, final=True)  # the last write of the turn always renews
    assert all(160 < ttl <= 170 for ttl in ttls()), ttls()


async def test_a_publish_sent_ahead_is_answered_later_even_across_a_script_flush(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    """The engine sends a step's publish and reads the reply after its next
    step: the same outcome as a plain call, and a Redis that lost its scripts
    meanwhile (restarted empty) still gets the step, once."""
    session, _ = await store.create(CHAT)
    _, claimed = _claim_next(worker)

    def delta(seq: int) -> Publish:
        return Publish(session, 1, claimed.epoch, seq, [DeltaEvent(seq, "a", [seq])], {"pub": seq})

    pending = worker.publish_start([delta(1)])
    stream = keys.turn_stream(session, 1)
    deadline = time.monotonic() + 5
    while redis_client.xlen(stream) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert redis_client.xlen(stream) == 1  # written before anyone reads the reply
    assert [r.outcome for r in pending.result()] == ["ok"]
    redis_client.script_flush()
    assert [r.outcome for r in worker.publish_start([delta(2)]).result()] == ["ok"]
    assert worker.read_generated(session, 1) == ([1, 2], 2)


async def test_a_publish_whose_reply_is_lost_is_sent_again_and_taken_once(
    store: SessionStore, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    session, _ = await store.create(CHAT)
    _, claimed = _claim_next(worker)
    item = Publish(session, 1, claimed.epoch, 1, [DeltaEvent(1, "a", [7])], {"pub": 1})
    pending = worker.publish_start([item])
    deadline = time.monotonic() + 5
    while not redis_client.exists(keys.turn_stream(session, 1)) and time.monotonic() < deadline:
        time.sleep(0.01)
    pending._connection.disconnect()  # Redis took the call; its reply is lost
    with pytest.raises(redis.ConnectionError):
        pending.result()
    assert [r.outcome for r in worker.publish_start([item]).result()] == ["ok"]
    assert worker.read_generated(session, 1) == ([7], 1)


async def test_one_step_publishes_many_turns_each_with_its_own_outcome(
    store: SessionStore, redis_client: redis.Redis, worker: WorkerStore
) -> None:
    """A step's turns go in one script call; each is checked and answered alone,
    in order, so one fenced or closed turn changes nothing for the others."""
    sessions = [await store.create(CHAT) for _ in range(4)]
    items = worker.read_work(10, None)
    assert len(items) == 4
    claims = {c.session: c for c in (worker.claim(i.request, takeover=False) for i in items) if c}
    (closed, closed_token), (first, _), (taken, _), (last, _) = sessions
    await store.close(closed, closed_token)
    other = WorkerStore(redis_client, "engine-b", ttl_s=60)
    stolen = other.take_over_expired(min_idle_ms=0, count=10)
    assert other.claim(next(t for t in stolen if t.request.session == taken).request, takeover=True)
    order = [closed, first, taken, last]
    step = [
        Publish(s, 1, claims[s].epoch, 2, [DeltaEvent(2, "ab", [i, i + 10])], {"pub": 1})
        for i, s in enumerate(order)
    ]
    outcomes = [r.outcome for r in worker.publish_many(step)]
    assert outcomes == ["not_found", "ok", "fenced", "ok"]
    assert worker.read_generated(first, 1) == ([1, 11], 2)
    assert worker.read_generated(last, 1) == ([3, 13], 2)
    assert worker.read_generated(taken, 1) == ([], 0)
    # The same step again (its reply lost to an outage): nothing written twice.
    assert [r.outcome for r in worker.publish_many(step[1:2])] == ["ok"]
    assert worker.read_generated(first, 1) == ([1, 11], 2)


# --- a queued turn whose work item was lost --------------------------------------------


def _lose_queued_items(redis_client: redis.Redis) -> None:
    """What a frontend that died between a turn's script and its XADD leaves: the
    turn queued, no item for any engine."""
    redis_client.xtrim(keys.REQUESTS, maxlen=0)


async def test_a_followed_turn_left_queued_gets_its_work_item_again_once_it_has_waited(
    aredis: aioredis.Redis, clock: ManualClock, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    store = SessionStore(aredis, ttl_s=60, clock=clock)
    session, _ = await store.create(CHAT)
    _lose_queued_items(redis_client)
    assert (await store.touch({session: 1}, resend_after_s=0.3)).resent == []  # first seen
    assert (await store.touch({session: 1}, resend_after_s=0.3)).resent == []  # too soon
    assert (await store.touch({session: 1})).resent == []  # no check asked for
    assert worker.read_work(10, None) == []
    clock.advance(0.35)  # the turn has now waited longer than resend_after_s
    assert (await store.touch({session: 1}, resend_after_s=0.3)).resent == [(session, 1)]
    assert (await store.touch({session: 1}, resend_after_s=0.3)).resent == []  # once a period
    item, claimed = _claim_next(worker)
    assert claimed is not None and (claimed.session, claimed.turn) == (session, 1)
    clock.advance(0.35)
    assert (await store.touch({session: 1}, resend_after_s=0.3)).resent == []  # running now
    assert redis_client.hget(keys.meta(session), "queued_mark") is None


async def test_a_resent_item_beside_the_original_runs_the_turn_once(
    aredis: aioredis.Redis, clock: ManualClock, worker: WorkerStore
) -> None:
    """The item was only slow, not lost: the duplicate's claim is refused."""
    store = SessionStore(aredis, ttl_s=60, clock=clock)
    session, _ = await store.create(CHAT)
    await store.touch({session: 1}, resend_after_s=0.1)
    clock.advance(0.15)
    assert (await store.touch({session: 1}, resend_after_s=0.1)).resent == [(session, 1)]
    items = worker.read_work(10, None)
    assert [i.request for i in items] == [items[0].request] * 2
    claims = [worker.claim(i.request, takeover=False) for i in items]
    assert claims[0] is not None and claims[1] is None


async def test_two_frontends_following_a_stuck_turn_resend_it_once_a_period(
    aredis: aioredis.Redis, clock: ManualClock, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    first, second = (SessionStore(aredis, ttl_s=60, clock=clock) for _ in range(2))
    session, _ = await first.create(CHAT)
    _lose_queued_items(redis_client)
    await first.touch({session: 1}, resend_after_s=0.2)
    clock.advance(0.25)
    resent = [await s.touch({session: 1}, resend_after_s=0.2) for s in (second, first)]
    assert [r.resent for r in resent] == [[(session, 1)], []]
    assert len(worker.read_work(10, None)) == 1


async def test_only_the_followed_latest_turn_while_queued_is_resent(
    aredis: aioredis.Redis, clock: ManualClock, worker: WorkerStore, redis_client: redis.Redis
) -> None:
    store = SessionStore(aredis, ttl_s=60, clock=clock)
    session, token = await store.create(CHAT)
    _lose_queued_items(redis_client)
    await store.control(session, token, 1, "pause")  # queued --pause--> paused
    await store.touch({session: 1}, resend_after_s=0.1)
    clock.advance(0.15)
    assert (await store.touch({session: 1}, resend_after_s=0.1)).resent == []
    # Resumed: queued again, its item written in a second call that is lost too.
    await store.control(session, token, 1, "resume")
    _lose_queued_items(redis_client)
    await store.touch({session: 1}, resend_after_s=0.1)
    clock.advance(0.15)
    assert (await store.touch({session: 1}, resend_after_s=0.1)).resent == [(session, 1)]
    assert _claim_next(worker)[1] is not None
