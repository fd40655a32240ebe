"""One reader per frontend for the delta streams of every attached session.

A single blocking XREAD covers all followed turn streams (plus this
frontend's wake-up stream, so that a new subscription does not wait for the
block to time out): one Redis connection per frontend, not one per session.
Each subscriber has its own position; the XREAD asks each stream from the
furthest-behind subscriber, and each entry goes only to subscribers that have
not seen it.

Exactly once rests on one rule (docs/architecture.md, step 6): a
subscriber's position only moves over entries handed to it. A reply holds the
entries after the position its read was sent with, and nothing before it; a
subscriber that is behind that position when the reply comes (it subscribed,
or was resumed, while the read was in flight) is handed nothing from it and
keeps its position: the next read starts from it.

Streams are split hot and cold. One XREAD names every stream it reads, and the
hot one is re-sent after each batch of entries, many times a second under
load: a stream quiet for ``COLD_AFTER_S`` (a paused turn, a turn waiting for an
engine, a client that stopped reading) moves to a second blocking XREAD, on a
connection of its own, that is re-sent only when its set changes or one of
its streams grows, which moves that stream back to the hot read. So thousands
of followed but idle sessions cost the hot path nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog

from wsinfer.clock import Clock
from wsinfer.sessions import keys
from wsinfer.sessions.connect import Backoff, is_cluster, is_outage
from wsinfer.sessions.schema import (
    DoneEvent,
    TurnEvent,
    as_str,
    decode_event_payload,
    entry_payload,
)

log = structlog.get_logger("wsinfer.fanin")

Deliver = Callable[[list[TurnEvent]], None]
# The wake-up stream outlives its frontend by this much at most.
WAKE_TTL_S = 60
# A followed stream this long without entries is read by the cold XREAD.
COLD_AFTER_S = 2.0
# How often the hot reader looks for streams gone quiet.
DEMOTE_EVERY_S = 0.5


def _raw_reply(response: Any, **options: Any) -> Any:
    """``[(stream, [[id, [b"m", payload]], ...]), ...]``: RESP3's map of streams
    as pairs, RESP2's list as it is."""
    if isinstance(response, dict):
        return list(response.items())
    return response or []


def raw_xread_client(redis: aioredis.Redis) -> aioredis.Redis:
    """A client on one connection of ``redis``'s pool, kept, whose XREAD replies are
    Redis's own nested lists: redis-py's parsing (a tuple and a dict per entry) was
    about a tenth of a relaying frontend's CPU, and the fan-in reads one field
    anyway; taking a connection from the pool and giving it back for every read
    was a seventh of what remained. One reader at a time: the hot and the cold
    XREAD each have their own."""
    client = aioredis.Redis(connection_pool=redis.connection_pool, single_connection_client=True)
    client.set_response_callback("XREAD", _raw_reply)
    return client


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Subscriber:
    deliver: Deliver
    position: str
    # A held subscriber (backpressure: its connection's client is not reading) is
    # neither read for nor delivered to; its output waits in Redis at its position.
    # Nothing to do with a turn's pause.
    held: bool = False


@dataclass
class _Stream:
    subscribers: dict[Hashable, _Subscriber] = field(default_factory=dict)
    last_data: float = 0.0  # the fan-in's clock at its last entries or subscription

    def position(self) -> str | None:
        if len(self.subscribers) == 1:  # the usual case, every stream every round
            (only,) = self.subscribers.values()
            return None if only.held else only.position
        active = [s.position for s in self.subscribers.values() if not s.held]
        return min(active, key=_id_key) if active else None


class _Waker:
    """XADDs to a wake-up stream that a blocking XREAD of this frontend reads.

    One wake-up in flight at a time: a burst of 1,000 subscriptions costs two
    XADDs, not 1,000 (a later one is folded into a second round).
    """

    def __init__(self, redis: aioredis.Redis, key: str) -> None:
        self.redis = redis
        self.key = key
        # Its stream is new with this frontend: from the start, no wake-up is missed.
        self.position = "0-0"
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def request(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._wake())
        else:
            self._again = True

    async def _wake(self) -> None:
        while True:
            self._again = False
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self.key, {"w": 1}, maxlen=16, approximate=True)
            pipe.expire(self.key, WAKE_TTL_S)
            try:
                await pipe.execute()
            except aioredis.RedisError as exc:
                log.warning("fan-in wake-up failed", error=str(exc))
                return  # the XREAD fails too, and re-reads everything once Redis is back
            if not self._again:
                return


class FanIn:
    """``clock``: monotonic seconds, which say when a stream has gone quiet."""

    def __init__(
        self,
        redis: aioredis.Redis,
        frontend_id: str,
        *,
        block_ms: int = 5000,
        clock: Clock = time.monotonic,
    ) -> None:
        self.redis = redis
        self.clock = clock
        # The hot and the cold XREAD's clients (a cluster's fan-in reads through its
        # own nodes).
        if is_cluster(redis):
            self.reader = self.cold_reader = redis
        else:
            self.reader, self.cold_reader = raw_xread_client(redis), raw_xread_client(redis)
        self.block_ms = block_ms
        self.streams: dict[str, _Stream] = {}
        self.owners: dict[Hashable, str] = {}
        self.hot: set[str] = set()  # read by the hot XREAD; the rest by the cold one
        self.cold: set[str] = set()
        self._hot_waker = _Waker(redis, keys.frontend_wake(frontend_id))
        self._cold_waker = _Waker(redis, keys.frontend_wake_cold(frontend_id))
        self._demoted_at = 0.0

    def subscribe(self, stream: str, owner: Hashable, position: str, deliver: Deliver) -> None:
        """Deliver entries of ``stream`` after ``position`` until its turn is done.

        An owner follows one stream at a time: subscribing again moves it.
        """
        self.unsubscribe(owner)
        self.streams.setdefault(stream, _Stream()).subscribers[owner] = _Subscriber(
            deliver, position
        )
        self.owners[owner] = stream
        self._promote(stream)
        self._request_wake()

    def unsubscribe(self, owner: Hashable) -> None:
        stream = self.owners.pop(owner, None)
        entry = self.streams.get(stream) if stream is not None else None
        if entry is not None:
            entry.subscribers.pop(owner, None)
            if not entry.subscribers:
                del self.streams[str(stream)]
                self.hot.discard(str(stream))
                self.cold.discard(str(stream))  # its cold XREAD is re-sent when next due

    def hold(self, owner: Hashable) -> None:
        """Backpressure: deliver nothing to ``owner`` (its client is not reading) until
        ``let_go``. Not a turn's pause: the turn runs on, its deltas wait in Redis."""
        sub = self._subscriber(owner)
        if sub is not None:
            sub.held = True

    def let_go(self, owner: Hashable) -> None:
        """Deliver again, from where the subscriber stopped."""
        sub = self._subscriber(owner)
        if sub is not None and sub.held:
            sub.held = False
            self._promote(self.owners[owner])
            self._request_wake()

    def _subscriber(self, owner: Hashable) -> _Subscriber | None:
        stream = self.streams.get(self.owners.get(owner, ""))
        return stream.subscribers.get(owner) if stream is not None else None

    def unsubscribe_all(self, matches: Callable[[Hashable], bool]) -> None:
        for owner in [o for o in self.owners if matches(o)]:
            self.unsubscribe(owner)

    def _request_wake(self) -> None:
        """Make the hot XREAD return, to be re-sent with the current streams."""
        self._hot_waker.request()

    def _promote(self, stream: str) -> None:
        entry = self.streams.get(stream)
        if entry is None:
            return
        entry.last_data = self.clock()
        self.cold.discard(stream)
        self.hot.add(stream)

    def _demote(self, now: float) -> None:
        """Move streams quiet for ``COLD_AFTER_S`` to the cold XREAD."""
        self._demoted_at = now
        cutoff = now - COLD_AFTER_S
        quiet = [s for s in self.hot if self.streams[s].last_data < cutoff]
        if quiet:
            self.hot.difference_update(quiet)
            self.cold.update(quiet)
            self._cold_waker.request()

    async def close(self) -> None:
        """Remove this frontend's wake-up stream (it also expires on its own)."""
        with contextlib.suppress(aioredis.RedisError):
            await self.redis.delete(self._hot_waker.key, self._cold_waker.key)
        for reader in (self.reader, self.cold_reader):
            if reader is self.redis:  # a cluster's: the fan-in reads through its nodes
                continue
            # A read cancelled while blocked can leave its reply pending on the socket:
            # the connection goes back to the pool closed, never with that reply (and
            # closing the pool later does not wait for Redis to send it).
            with contextlib.suppress(aioredis.RedisError, OSError):
                if reader.connection is not None:
                    await reader.connection.disconnect()
                await reader.aclose()

    async def run(self) -> None:
        """Read and dispatch until cancelled; rides out Redis outages with backoff."""
        await asyncio.gather(*(self._loop(read) for read in self._readers()))

    def _readers(self) -> list[Callable[[], Awaitable[None]]]:
        return [self._read_once, self._read_cold]

    async def _loop(self, read: Callable[[], Awaitable[None]]) -> None:
        backoff = Backoff()
        while True:
            try:
                await read()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not backoff.down:  # one line per outage, not one per retry
                    log.warning("fan-in cannot read from redis; retrying", error=str(exc))
                    if not is_outage(exc):
                        log.exception("fan-in read failed")
                await asyncio.sleep(backoff.failed())
                continue
            lasted = backoff.reset()
            if lasted is not None:
                log.warning("fan-in reading again", down_s=round(lasted, 1))

    async def _read_once(self) -> None:
        """One blocking XREAD of the hot streams (and the hot wake-up stream)."""
        await self._xread(self.hot, self._hot_waker, self.reader)
        now = self.clock()
        if now - self._demoted_at >= DEMOTE_EVERY_S:
            self._demote(now)

    async def _read_cold(self) -> None:
        """One blocking XREAD of the quiet streams; one that grows turns hot."""
        grew = await self._xread(self.cold, self._cold_waker, self.cold_reader)
        for stream in grew:
            self._promote(stream)
        if grew:  # the hot XREAD in flight does not name them yet
            self._request_wake()

    async def _xread(self, streams: set[str], waker: _Waker, reader: aioredis.Redis) -> list[str]:
        """XREAD ``streams`` from their positions; dispatch; the streams that grew."""
        wanted: dict[Any, Any] = {}
        for stream in streams:
            position = self.streams[stream].position()
            if position is not None:
                wanted[stream] = position
        wanted[waker.key] = waker.position
        reply: Any = await reader.xread(wanted, block=self.block_ms)
        grew = []
        for raw_stream, entries in reply:
            stream = as_str(raw_stream)
            if stream == waker.key:
                waker.position = as_str(entries[-1][0])
            elif entries:
                grew.append(stream)
                read_from = wanted[stream]
                self._dispatch(
                    stream, read_from, [(as_str(i), entry_payload(f)) for i, f in entries]
                )
        return grew

    def _dispatch(
        self, stream: str, read_from: str, entries: list[tuple[str, bytes | None]]
    ) -> None:
        """Deliver ``(entry id, packed event)`` pairs of ``stream``, all of its
        entries after ``read_from`` so far, to its subscribers."""
        entry = self.streams.get(stream)
        if entry is None:
            return
        entry.last_data = self.clock()
        # Hot path (every delta of every followed turn): each id is parsed once.
        decoded = [(_id_key(entry_id), decode_event_payload(raw)) for entry_id, raw in entries]
        last_id, last_key = entries[-1][0], decoded[-1][0]
        start = _id_key(read_from)
        for owner, sub in list(entry.subscribers.items()):
            if sub.held:
                continue
            seen = _id_key(sub.position)
            if seen < start:  # behind this read (see the module's doc): left for the next
                continue
            fresh = [ev for key, ev in decoded if key > seen]
            if last_key > seen:
                sub.position = last_id
            if fresh:
                sub.deliver(fresh)
            if any(isinstance(ev, DoneEvent) for ev in fresh):
                self.unsubscribe(owner)
