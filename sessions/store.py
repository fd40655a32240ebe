"""The frontend's view of session state in Redis (asyncio).

Owns the client-driven transitions: start a turn, stop, pause, resume, close,
plus reading a turn's events for replay. The engine's side is ``worker.py``.
"""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from wsinfer.sessions import keys, scripts
from wsinfer.sessions.connect import ScriptCall, is_cluster, run_scripts_async
from wsinfer.sessions.connection import queue_script, run_pipeline
from wsinfer.sessions.schema import (
    GenerationParams,
    TurnEvent,
    TurnRequest,
    as_str,
    decode_event,
    encode,
)
from wsinfer.sessions.states import Action, IllegalTransition, Status, allowed_from, target

DEFAULT_SESSION_TTL_S = 3600
# How long a closed session's last stream stays, so followers see its end.
CLOSE_LINGER_S = 30
# An engine whose last heartbeat is older than this is not routed to.
ENGINE_FRESH_S = 5.0


class SessionNotFound(Exception):
    """No such session, or the token does not match (indistinguishable on purpose)."""


class ModeMismatch(Exception):
    """A chat session got a raw prompt, or a prompt session got messages."""


@dataclass(frozen=True)
class TurnInput:
    """What a client asked for in one ``generate``: the engine renders it."""

    mode: str  # "chat" (messages) or "text" (prompt)
    messages: list[dict[str, str]] | None
    prompt: str | None
    params: GenerationParams

    def pack(self) -> bytes:
        data = {
            "mode": self.mode,
            "messages": self.messages,
            "prompt": self.prompt,
            "params": self.params.to_dict(),
        }
        return bytes(msgpack.packb(data, use_bin_type=True))

    @classmethod
    def unpack(cls, raw: bytes) -> TurnInput:
        data = msgpack.unpackb(raw, raw=False)
        data["params"] = GenerationParams.from_dict(data["params"])
        return cls(**data)


@dataclass(frozen=True)
class SessionInfo:
    session: str
    turn: int
    status: str
    seq: int
    engine: str
    kv_engine: str = ""


@dataclass(frozen=True)
class ControlResult:
    effect: str  # what the script did: control:stop, done_cancelled, paused, requeue
    status: str
    seq: int


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class SessionStore:
    """Client-driven session operations; every key comes from ``keys``."""

    def __init__(self, redis: aioredis.Redis, *, ttl_s: int = DEFAULT_SESSION_TTL_S) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self._start = redis.register_script(scripts.START_TURN)
        self._control = redis.register_script(scripts.CONTROL)
        self._touch = redis.register_script(scripts.TOUCH)
        self._close = redis.register_script(scripts.CLOSE)

    async def create(self, turn_input: TurnInput) -> tuple[str, str]:
        """New session with its first turn queued; returns (session, token).

        One round trip: the start script and the work item go in one pipeline.
        """
        session, token = uuid.uuid4().hex, secrets.token_urlsafe(24)
        await self._start_turn(session, hash_token(token), True, 1, turn_input, keys.REQUESTS)
        return session, token

    async def add_turn(
        self, session: str, token: str, turn_input: TurnInput, alive: frozenset[str] | None = None
    ) -> int:
        """Queue the next turn of an existing session; returns its number.

        ``alive``: the engines known to be alive (saves a round trip per turn).
        """
        info = await self.info(session, token)
        queue = await self._queue_for(info.kv_engine, alive)
        await self._start_turn(session, hash_token(token), False, info.turn + 1, turn_input, queue)
        return info.turn + 1

    async def _start_turn(
        self,
        session: str,
        token_hash: str,
        is_new: bool,
        turn: int,
        turn_input: TurnInput,
        queue: str,
    ) -> None:
        # The work item goes with the script in one round trip. When the script
        # refuses, the item is a harmless stray: an engine's claim of a turn
        # that is not queued fails, and it acks the item.
        status_from = ",".join(s.value for s in allowed_from(Action.START))
        script_keys = [keys.meta(session), keys.turn_input(session, turn), *_others(session, turn)]
        args = [
            token_hash,
            "1" if is_new else "0",
            turn,
            turn_input.mode,
            turn_input.pack(),
            time.time(),
            self.ttl_s,
            status_from,
            target(Action.START).value,
        ]
        item = encode(TurnRequest(session, turn))
        if is_cluster(self.redis):  # the queue lives on another node: two calls
            reply = await self._start(keys=script_keys, args=args)
            await self.redis.xadd(queue, item, maxlen=keys.REQUESTS_MAXLEN)
        else:

            def build(pipe: Pipeline) -> None:
                queue_script(pipe, self._start, script_keys, args)
                pipe.xadd(queue, item, maxlen=keys.REQUESTS_MAXLEN)

            reply, queued = await run_pipeline(self.redis, build, [self._start])
            for result in (reply, queued):
                if isinstance(result, Exception):
                    raise result
        outcome = [as_str(v) for v in reply]
        if outcome[0] == "not_found":
            raise SessionNotFound(session)
        if outcome[0] in ("illegal", "stale"):
            raise IllegalTransition(Action.START, outcome[1] if len(outcome) > 1 else "busy")
        if outcome[0] == "mode":
            raise ModeMismatch(
                f"this session takes {'messages' if outcome[1] == 'chat' else 'prompt'}"
            )

    async def _queue_for(self, holder: str, alive: frozenset[str] | None) -> str:
        """The engine holding the session's KV cache if it is alive, else the shared queue."""
        if not holder:
            return keys.REQUESTS
        if alive is None:
            beat = await self.redis.zscore(keys.ENGINES, holder)
            fresh = beat is not None and time.time() - beat < ENGINE_FRESH_S
        else:
            fresh = holder in alive
        return keys.engine_requests(holder) if fresh else keys.REQUESTS

    async def enqueue(self, session: str, turn: int) -> None:
        """Hand the turn to the engine holding the session's KV cache if it is
        alive, else to whichever engine reads the shared queue first."""
        holder = await self.redis.hget(keys.meta(session), "kv_engine")
        queue = await self._queue_for(as_str(holder) if holder else "", None)
        # Trimmed so a queue cannot grow without bound; the frontend refuses
        # new turns (overloaded) long before this many are waiting.
        await self.redis.xadd(
            queue, encode(TurnRequest(session, turn)), maxlen=keys.REQUESTS_MAXLEN
        )

    async def info(self, session: str, token: str) -> SessionInfo:
        raw = await self.redis.hgetall(keys.meta(session))
        meta = {as_str(k): as_str(v) for k, v in raw.items()}
        if not meta or not secrets.compare_digest(meta.get("token", ""), hash_token(token)):
            raise SessionNotFound(session)
        return SessionInfo(
            session,
            int(meta["turn"]),
            meta["status"],
            int(meta["seq"]),
            meta.get("engine", ""),
            meta.get("kv_engine", ""),
        )

    async def control(self, session: str, token: str, turn: int, action: str) -> ControlResult:
        """Apply a client's stop/pause/resume to ``turn`` atomically."""
        candidates = _CONTROL_CANDIDATES[action]
        args: list[Any] = [hash_token(token), turn, self.ttl_s, int(time.time()), len(candidates)]
        for act, effect in candidates:
            args += [",".join(s.value for s in allowed_from(act)), target(act).value, effect]
        reply = [
            as_str(v)
            for v in await self._control(
                keys=[
                    keys.meta(session),
                    keys.turn_stream(session, turn),
                    keys.session_wake(session),
                ],
                args=args,
            )
        ]
        if reply[0] == "not_found":
            raise SessionNotFound(session)
        if reply[0] == "stale":
            raise IllegalTransition(candidates[0][0], "no longer the latest turn")
        if reply[0] == "illegal":
            raise IllegalTransition(candidates[0][0], reply[1])
        result = ControlResult(effect=reply[1], status=reply[2], seq=int(reply[3]))
        if result.effect == "requeue":
            await self.enqueue(session, turn)
        return result

    async def close(self, session: str, token: str) -> None:
        """Delete the session; a running engine sees it gone and stops, and
        followers elsewhere get a cancelled ``done`` (the latest turn's stream
        lingers for ``CLOSE_LINGER_S`` so their fan-ins can deliver it)."""
        info = await self.info(session, token)
        stream = keys.turn_stream(session, info.turn)
        mine = keys.session_keys(session, info.turn)
        others = [k for k in mine if k not in (keys.meta(session), stream)]
        reply = await self._close(
            keys=[keys.meta(session), stream, *others], args=[hash_token(token), CLOSE_LINGER_S]
        )
        if as_str(reply[0]) == "not_found":
            raise SessionNotFound(session)

    async def touch(self, sessions: dict[str, int]) -> list[str]:
        """Mark followed sessions as watched and push back their expiry (one round trip
        per Redis node).

        Returns the sessions that no longer exist (closed, expired, or lost
        with a Redis that restarted without persistence).
        """
        now = time.time()
        calls: list[ScriptCall] = [
            (self._touch, keys.session_keys(session, turns), [now, self.ttl_s])
            for session, turns in sessions.items()
        ]
        replies = await run_scripts_async(self.redis, calls)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [s for s, found in zip(sessions, replies, strict=True) if not found]

    async def read_turn(self, session: str, turn: int) -> tuple[list[TurnEvent], str]:
        """Every event of a turn so far, and the stream id to follow live from."""
        entries = await self.redis.xrange(keys.turn_stream(session, turn)) or []
        events = [decode_event(fields) for _, fields in entries]
        last_id = as_str(entries[-1][0]) if entries else "0-0"
        return events, last_id

    async def engines_alive(self, within_s: float) -> int:
        return int(await self.redis.zcount(keys.ENGINES, time.time() - within_s, "+inf"))

    async def capacity(self, within_s: float) -> tuple[frozenset[str], int]:
        """The engines alive now and the turns waiting for one, in one round trip."""
        pipe: Pipeline = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(keys.ENGINES, time.time() - within_s, "+inf")
        pipe.xinfo_groups(keys.REQUESTS)
        pipe.xlen(keys.REQUESTS)
        names, groups, length = await pipe.execute(raise_on_error=False)
        if isinstance(names, Exception):
            raise names
        alive = frozenset(as_str(n) for n in names)
        if isinstance(groups, Exception) or isinstance(length, Exception):
            return alive, 0  # no queue yet: nothing is waiting
        for group in groups:
            if as_str(group["name"]) == keys.ENGINE_GROUP:
                return alive, int(group.get("lag") or 0)
        return alive, int(length)

    async def queue_depth(self) -> int:
        """Turns queued but not yet taken by any engine."""
        try:
            groups = await self.redis.xinfo_groups(keys.REQUESTS)
        except aioredis.ResponseError:
            return 0
        for group in groups:
            if as_str(group["name"]) == keys.ENGINE_GROUP:
                return int(group.get("lag") or 0)
        return int(await self.redis.xlen(keys.REQUESTS))


def _others(session: str, turn: int) -> list[str]:
    """The session's keys other than its meta and this turn's input: a turn
    start pushes back their expiry too, so no earlier turn expires first."""
    skip = {keys.meta(session), keys.turn_input(session, turn)}
    return [k for k in keys.session_keys(session, turn) if k not in skip]


# For each client action, the transitions to try in order, with what each does.
_CONTROL_CANDIDATES: dict[str, list[tuple[Action, str]]] = {
    "stop": [(Action.REQUEST_STOP, "control:stop"), (Action.STOP, "done_cancelled")],
    "pause": [(Action.REQUEST_PAUSE, "control:pause"), (Action.PAUSE, "paused")],
    "resume": [(Action.RESUME, "requeue")],
}

__all__ = [
    "ControlResult",
    "ModeMismatch",
    "SessionInfo",
    "SessionNotFound",
    "SessionStore",
    "Status",
    "TurnInput",
    "hash_token",
]
