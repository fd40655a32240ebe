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
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog

from wsinfer.sessions import keys
from wsinfer.sessions.schema import DoneEvent, TurnEvent, as_str, decode_event

log = structlog.get_logger("wsinfer.fanin")

Deliver = Callable[[list[TurnEvent]], None]


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


@dataclass
class _Subscriber:
    deliver: Deliver
    position: str


@dataclass
class _Stream:
    subscribers: dict[Hashable, _Subscriber] = field(default_factory=dict)

    def position(self) -> str:
        return min((s.position for s in self.subscribers.values()), key=_id_key)


class FanIn:
    def __init__(self, redis: aioredis.Redis, frontend_id: str, *, block_ms: int = 5000) -> None:
        self.redis = redis
        self.wake_key = keys.frontend_wake(frontend_id)
        self.block_ms = block_ms
        self.streams: dict[str, _Stream] = {}
        self.owners: dict[Hashable, str] = {}
        self._wake_position = "$"

    def subscribe(self, stream: str, owner: Hashable, position: str, deliver: Deliver) -> None:
        """Deliver entries of ``stream`` after ``position`` until its turn is done.

        An owner follows one stream at a time: subscribing again moves it.
        """
        self.unsubscribe(owner)
        self.streams.setdefault(stream, _Stream()).subscribers[owner] = _Subscriber(
            deliver, position
        )
        self.owners[owner] = stream
        asyncio.get_running_loop().create_task(self._wake())

    def unsubscribe(self, owner: Hashable) -> None:
        stream = self.owners.pop(owner, None)
        entry = self.streams.get(stream) if stream is not None else None
        if entry is not None:
            entry.subscribers.pop(owner, None)
            if not entry.subscribers:
                del self.streams[str(stream)]

    def unsubscribe_all(self, matches: Callable[[Hashable], bool]) -> None:
        for owner in [o for o in self.owners if matches(o)]:
            self.unsubscribe(owner)

    async def _wake(self) -> None:
        try:
            await self.redis.xadd(self.wake_key, {"w": 1}, maxlen=16, approximate=True)
        except aioredis.RedisError:
            log.warning("fan-in wake-up failed")

    async def run(self) -> None:
        """Read and dispatch until cancelled; survives Redis hiccups."""
        while True:
            try:
                await self._read_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fan-in read failed; retrying")
                await asyncio.sleep(0.5)

    async def _read_once(self) -> None:
        wanted: dict[Any, Any] = {
            stream: entry.position() for stream, entry in self.streams.items()
        }
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
        decoded = [(entry_id, decode_event(fields)) for entry_id, fields in entries]
        for owner, sub in list(entry.subscribers.items()):
            fresh = [ev for eid, ev in decoded if _id_key(eid) > _id_key(sub.position)]
            sub.position = max(sub.position, decoded[-1][0], key=_id_key)
            if fresh:
                sub.deliver(fresh)
            if any(isinstance(ev, DoneEvent) for ev in fresh):
                self.unsubscribe(owner)
