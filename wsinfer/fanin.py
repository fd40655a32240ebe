"""One reader per frontend for the delta streams of every attached session.

A single blocking XREAD covers all followed turn streams (plus this
frontend's wake-up stream, so that a new subscription does not wait for the
block to time out): one Redis connection per frontend, not one per session.
Each subscriber has its own position; the XREAD asks each stream from the
furthest-behind subscriber, and each entry goes only to subscribers that have
not seen it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog

from wsinfer.sessions import keys
from wsinfer.sessions.connection import Backoff, is_outage
from wsinfer.sessions.schema import DoneEvent, TurnEvent, as_str, decode_event

log = structlog.get_logger("wsinfer.fanin")

Deliver = Callable[[list[TurnEvent]], None]
# The wake-up stream outlives its frontend by this much at most.
WAKE_TTL_S = 60


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Subscriber:
    deliver: Deliver
    position: str
    # A paused subscriber (its connection's client is not reading) is neither
    # read for nor delivered to; its output waits in Redis at its position.
    paused: bool = False


@dataclass
class _Stream:
    subscribers: dict[Hashable, _Subscriber] = field(default_factory=dict)

    def position(self) -> str | None:
        active = [s.position for s in self.subscribers.values() if not s.paused]
        return min(active, key=_id_key) if active else None


class FanIn:
    def __init__(self, redis: aioredis.Redis, frontend_id: str, *, block_ms: int = 5000) -> None:
        self.redis = redis
        self.wake_key = keys.frontend_wake(frontend_id)
        self.block_ms = block_ms
        self.streams: dict[str, _Stream] = {}
        self.owners: dict[Hashable, str] = {}
        self._wake_position = "$"
        self._wake_task: asyncio.Task[None] | None = None
        self._wake_again = False

    def subscribe(self, stream: str, owner: Hashable, position: str, deliver: Deliver) -> None:
        """Deliver entries of ``stream`` after ``position`` until its turn is done.

        An owner follows one stream at a time: subscribing again moves it.
        """
        self.unsubscribe(owner)
        self.streams.setdefault(stream, _Stream()).subscribers[owner] = _Subscriber(
            deliver, position
        )
        self.owners[owner] = stream
        self._request_wake()

    def unsubscribe(self, owner: Hashable) -> None:
        stream = self.owners.pop(owner, None)
        entry = self.streams.get(stream) if stream is not None else None
        if entry is not None:
            entry.subscribers.pop(owner, None)
            if not entry.subscribers:
                del self.streams[str(stream)]

    def pause(self, owner: Hashable) -> None:
        sub = self._subscriber(owner)
        if sub is not None:
            sub.paused = True

    def resume(self, owner: Hashable) -> None:
        """Deliver again, from where the subscriber stopped."""
        sub = self._subscriber(owner)
        if sub is not None and sub.paused:
            sub.paused = False
            self._request_wake()

    def _subscriber(self, owner: Hashable) -> _Subscriber | None:
        stream = self.streams.get(self.owners.get(owner, ""))
        return stream.subscribers.get(owner) if stream is not None else None

    def unsubscribe_all(self, matches: Callable[[Hashable], bool]) -> None:
        for owner in [o for o in self.owners if matches(o)]:
            self.unsubscribe(owner)

    def _request_wake(self) -> None:
        """One wake-up in flight at a time: a burst of 1,000 subscriptions costs
        two XADDs, not 1,000 (a later one is folded into a second round)."""
        if self._wake_task is None or self._wake_task.done():
            self._wake_task = asyncio.get_running_loop().create_task(self._wake())
        else:
            self._wake_again = True

    async def _wake(self) -> None:
        while True:
            self._wake_again = False
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self.wake_key, {"w": 1}, maxlen=16, approximate=True)
            pipe.expire(self.wake_key, WAKE_TTL_S)
            try:
                await pipe.execute()
            except aioredis.RedisError as exc:
                log.warning("fan-in wake-up failed", error=str(exc))
                return  # the XREAD fails too, and re-reads everything once Redis is back
            if not self._wake_again:
                return

    async def close(self) -> None:
        """Remove this frontend's wake-up stream (it also expires on its own)."""
        with contextlib.suppress(aioredis.RedisError):
            await self.redis.delete(self.wake_key)

    async def run(self) -> None:
        """Read and dispatch until cancelled; rides out Redis outages with backoff."""
        backoff = Backoff()
        while True:
            try:
                await self._read_once()
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
        wanted: dict[Any, Any] = {}
        for stream, entry in self.streams.items():
            position = entry.position()
            if position is not None:
                wanted[stream] = position
        wanted[self.wake_key] = self._wake_position
        reply: Any = await self.redis.xread(wanted, block=self.block_ms)
        for raw_stream, entries in reply or []:
            stream = as_str(raw_stream)
            if stream == self.wake_key:
                self._wake_position = as_str(entries[-1][0])
            elif entries:
                self._dispatch(stream, [(as_str(i), f) for i, f in entries])

    def _dispatch(self, stream: str, entries: list[tuple[str, Any]]) -> None:
        entry = self.streams.get(stream)
        if entry is None:
            return
        # Hot path (every delta of every followed turn): each id is parsed once.
        decoded = [(_id_key(entry_id), decode_event(fields)) for entry_id, fields in entries]
        last_id, last_key = entries[-1][0], decoded[-1][0]
        for owner, sub in list(entry.subscribers.items()):
            if sub.paused:
                continue
            seen = _id_key(sub.position)
            fresh = [ev for key, ev in decoded if key > seen]
            if last_key > seen:
                sub.position = last_id
            if fresh:
                sub.deliver(fresh)
            if any(isinstance(ev, DoneEvent) for ev in fresh):
                self.unsubscribe(owner)


def make_fanin(redis: aioredis.Redis, frontend_id: str) -> FanIn:
    """The fan-in for this Redis: one XREAD, or one reader per node on a cluster."""
    from wsinfer.sessions.connect import is_cluster

    if is_cluster(redis):
        from wsinfer.fanin_cluster import ClusterFanIn

        return ClusterFanIn(redis, frontend_id)
    return FanIn(redis, frontend_id)
