"""The frontend's view of session state in Redis (asyncio).

Owns the client-driven transitions: start a turn, stop, pause, resume, close,
plus reading a turn's events for replay. The engine's side is ``worker.py``
(synchronous); what both share (the turn record, settings) is ``schema.py``,
so neither process imports the other's client code.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from wsinfer.clock import Clock
from wsinfer.contract import ClientMessageType, TurnStatus
from wsinfer.sessions import keys, scripts
from wsinfer.sessions.connect import is_cluster
from wsinfer.sessions.schema import (
    CLOSE_LINGER_S,
    DEFAULT_SESSION_TTL_S,
    ENGINE_FRESH_S,
    PausedEvent,
    SessionMeta,
    TurnEvent,
    TurnInput,
    TurnRequest,
    as_str,
    decode_event,
    encode,
    engine_group_lag,
    pack,
)
from wsinfer.sessions.scripting import (
    ScriptCall,
    bound,
    queue_script,
    run_pipeline,
    run_scripts_async,
)
from wsinfer.sessions.scripts import (
    CloseCall,
    ControlCall,
    Reply,
    StartTurnCall,
    TouchCall,
    WatchUntilCall,
)
from wsinfer.sessions.states import (
    Action,
    Effect,
    IllegalTransition,
    allowed_from,
    required_finish,
    statuses_arg,
    store_candidates,
    target,
)

# Attempts at a write whose pre-encoded event an engine's publish outdated
# meanwhile (``moved``): each retry reads the counters afresh.
MOVED_RETRIES = 20


class SessionNotFound(Exception):
    """No such session, or the token does not match (indistinguishable on purpose)."""


class ModeMismatch(Exception):
    """A chat session got a raw prompt, or a prompt session got messages."""


@dataclass(frozen=True)
class SessionInfo:
    session: str
    turn: int
    status: str
    seq: int
    engine: str
    kv_engine: str = ""
    meta: SessionMeta = field(default_factory=SessionMeta)


@dataclass(frozen=True)
class Started:
    """A generate's outcome: the turn it started, or (``repeat``) the turn an
    earlier generate with the same idempotency key started."""

    session: str
    token: str
    turn: int
    status: str
    repeat: bool = False


@dataclass(frozen=True)
class ControlResult:
    effect: Effect  # what the script did
    status: TurnStatus  # the turn's status after it
    seq: int


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def hash_idempotency_key(key: str) -> str:
    """What Redis keeps of a key: it names the turn without revealing the key."""
    return hashlib.sha256(b"wsinfer-idem:" + key.encode()).hexdigest()


def token_for_key(key: str) -> str:
    """The token of a session made by a generate with an idempotency key.

    Derived, not stored: a repeat must answer the same token, and Redis only
    ever holds a token's hash. The key is as secret as the token it yields.
    """
    digest = hashlib.sha256(b"wsinfer-token:" + key.encode()).digest()
    return base64.urlsafe_b64encode(digest).decode()[:32]


class SessionStore:
    """Client-driven session operations; every key comes from ``keys``.

    ``clock``: wall-clock seconds, as the engines' heartbeats and the times the
    scripts keep (``seen_at``, a queued turn's resend period) are compared
    across processes.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        ttl_s: int = DEFAULT_SESSION_TTL_S,
        clock: Clock = time.time,
    ) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.clock = clock
        self._start = redis.register_script(scripts.START_TURN)
        self._control = redis.register_script(scripts.CONTROL)
        self._touch = redis.register_script(scripts.TOUCH)
        self._close = redis.register_script(scripts.CLOSE)
        self._watch_until = redis.register_script(scripts.WATCH_UNTIL)

    async def create(self, turn_input: TurnInput) -> tuple[str, str]:
        """New session with its first turn queued; returns (session, token).

        One round trip: the start script and the work item go in one pipeline.
        """
        session, token = uuid.uuid4().hex, secrets.token_urlsafe(24)
        await self._start_turn(session, hash_token(token), True, 1, turn_input, keys.REQUESTS)
        return session, token

    async def create_once(self, turn_input: TurnInput, key: str) -> Started:
        """``create``, unless a generate with this idempotency key already made
        the session: then that one's first turn. Two racing with one key make
        one session: the key's record names the session id (SET NX), and both
        run the same start script on it, which starts the turn once."""
        candidate = uuid.uuid4().hex
        previous = await self.redis.set(
            keys.idempotency(hash_idempotency_key(key)), candidate, nx=True, get=True, ex=self.ttl_s
        )
        session, token = as_str(previous) if previous else candidate, token_for_key(key)
        repeat = await self._start_turn(
            session, hash_token(token), True, 1, turn_input, keys.REQUESTS, key
        )
        return _started(session, token, 1, repeat)

    async def add_turn_once(
        self, session: str, token: str, turn_input: TurnInput, key: str, alive: frozenset[str]
    ) -> Started:
        """``add_turn``, unless a generate with this idempotency key already
        started a turn of this session: then that turn."""
        info = await self.info(session, token)
        queue = await self._queue_for(info.kv_engine, alive)
        turn = info.turn + 1
        repeat = await self._start_turn(
            session, hash_token(token), False, turn, turn_input, queue, key
        )
        return _started(session, token, turn, repeat)

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
        key: str | None = None,
    ) -> tuple[int, str] | None:
        """Start the turn; a repeat of an idempotency key returns that turn and
        its status instead."""
        # The work item goes with the script in one round trip. When the script
        # refuses, the item is a harmless stray: an engine's claim of a turn
        # that is not queued fails, and it acks the item.
        call = StartTurnCall(
            meta=keys.meta(session),
            turn_input=keys.turn_input(session, turn),
            other_keys=_others(session, turn, keys.turn_input(session, turn)),
            token_hash=token_hash,
            is_new="1" if is_new else "0",
            next_turn=turn,
            mode=turn_input.mode,
            packed_input=turn_input.pack(),
            now=self.clock(),
            session_ttl=self.ttl_s,
            allowed_from=statuses_arg(allowed_from(Action.START)),
            target=target(Action.START).value,
            idem_hash=hash_idempotency_key(key) if key else "",
        )
        script_keys, args = call.keys(), call.args()
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
        if outcome[0] == Reply.REPEAT:
            return int(outcome[1]), outcome[2]
        if outcome[0] == Reply.NOT_FOUND:
            raise SessionNotFound(session)
        if outcome[0] in (Reply.ILLEGAL, Reply.STALE):
            raise IllegalTransition(Action.START, outcome[1] if len(outcome) > 1 else "busy")
        if outcome[0] == Reply.MODE:
            raise ModeMismatch(
                f"this session takes {'messages' if outcome[1] == 'chat' else 'prompt'}"
            )
        return None

    async def _queue_for(self, holder: str, alive: frozenset[str] | None) -> str:
        """The engine holding the session's KV cache if it is alive, else the shared queue."""
        if not holder:
            return keys.REQUESTS
        if alive is None:
            beat = await self.redis.zscore(keys.ENGINES, holder)
            fresh = beat is not None and self.clock() - beat < ENGINE_FRESH_S
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
        meta = SessionMeta.from_hash(await self.redis.hgetall(keys.meta(session)))
        if not meta.token or not secrets.compare_digest(meta.token, hash_token(token)):
            raise SessionNotFound(session)
        return SessionInfo(
            session, meta.turn, meta.status, meta.seq, meta.engine, meta.kv_engine, meta
        )

    async def control(
        self, session: str, token: str, turn: int, action: ClientMessageType
    ) -> ControlResult:
        """Apply a client's stop/pause/resume to ``turn`` atomically: the first of
        the table's transitions for it that the turn's status allows."""
        candidates = store_candidates(ClientMessageType(action))
        rows = [
            (statuses_arg(allowed_from(act)), target(act).value, effect.value, _finish_arg(act))
            for act, effect in candidates
        ]
        for _ in range(MOVED_RETRIES):
            meta = (await self.info(session, token)).meta
            call = ControlCall(
                meta=keys.meta(session),
                turn_stream=keys.turn_stream(session, turn),
                session_wake=keys.session_wake(session),
                token_hash=hash_token(token),
                turn=turn,
                fallback_ttl=self.ttl_s,
                now=int(self.clock()),
                expected_counters=meta.counters(),
                paused_event=pack(PausedEvent(meta.seq)),
                cancelled_event=pack(meta.cancelled()),
                candidates=rows,
            )
            reply = [as_str(v) for v in await self._control(keys=call.keys(), args=call.args())]
            if reply[0] != Reply.MOVED:
                return await self._controlled(session, turn, candidates[0][0], reply)
        raise RuntimeError(f"session {session} kept moving under a {action}")

    async def _controlled(
        self, session: str, turn: int, action: Action, reply: list[str]
    ) -> ControlResult:
        if reply[0] == Reply.NOT_FOUND:
            raise SessionNotFound(session)
        if reply[0] == Reply.STALE:
            raise IllegalTransition(action, "no longer the latest turn")
        if reply[0] == Reply.ILLEGAL:
            raise IllegalTransition(action, reply[1])
        result = ControlResult(Effect(reply[1]), TurnStatus(reply[2]), int(reply[3]))
        if result.effect is Effect.REQUEUE:
            await self.enqueue(session, turn)
        return result

    async def keep_running(self, session: str, token: str, turn: int) -> None:
        """Exempt the latest turn from the idle pause for the session's TTL: it
        runs on with nobody watching (a ``background`` response)."""
        call = WatchUntilCall(
            meta=keys.meta(session),
            token_hash=hash_token(token),
            turn=turn,
            now=self.clock(),
            fallback_ttl=self.ttl_s,
        )
        reply = [as_str(v) for v in await self._watch_until(keys=call.keys(), args=call.args())]
        if reply[0] == Reply.NOT_FOUND:
            raise SessionNotFound(session)
        if reply[0] == Reply.STALE:
            raise IllegalTransition(Action.START, "no longer the latest turn")

    async def turn_created(self, session: str, turn: int) -> int:
        """When a turn started (unix seconds; 0 if not recorded)."""
        return int(await self.redis.hget(keys.meta(session), f"created:{turn}") or 0)

    async def turn_record(self, session: str, turn: int) -> tuple[int, TurnInput | None]:
        """When a turn started (unix seconds; 0 if not recorded) and its input."""
        pipe: Pipeline = self.redis.pipeline(transaction=False)
        pipe.hget(keys.meta(session), f"created:{turn}")
        pipe.get(keys.turn_input(session, turn))
        created, raw = await pipe.execute()
        return int(created or 0), TurnInput.unpack(raw) if raw else None

    async def close(self, session: str, token: str) -> None:
        """Delete the session; a running engine sees it gone and stops, and
        followers elsewhere get a cancelled ``done`` (the latest turn's stream
        lingers for ``CLOSE_LINGER_S`` so their fan-ins can deliver it)."""
        for _ in range(MOVED_RETRIES):
            info = await self.info(session, token)
            stream = keys.turn_stream(session, info.turn)
            call = CloseCall(
                meta=keys.meta(session),
                turn_stream=stream,
                other_keys=_others(session, info.turn, stream),
                token_hash=hash_token(token),
                linger_s=CLOSE_LINGER_S,
                expected_counters=info.meta.counters(),
                cancelled_event=pack(info.meta.cancelled()),
            )
            reply = await self._close(keys=call.keys(), args=call.args())
            if as_str(reply[0]) == Reply.NOT_FOUND:
                raise SessionNotFound(session)
            if as_str(reply[0]) == Reply.OK:
                return
        raise RuntimeError(f"session {session} kept moving under a close")

    async def touch(self, sessions: dict[str, int], resend_after_s: float = 0.0) -> Touched:
        """Mark followed sessions (each with the turn followed) as watched and push
        back their expiry, one round trip per Redis node.

        ``gone``: the sessions that no longer exist (closed, expired, or lost with a
        Redis that restarted without persistence). With ``resend_after_s``, the
        followed turns queued that long without a claim get their work item again
        (``resent``): the process that queued one may have died before writing it.
        """
        now = self.clock()
        queued, after = TurnStatus.QUEUED.value, max(resend_after_s, 0.0)
        calls: list[ScriptCall] = [
            bound(
                self._touch,
                TouchCall(
                    meta=keys.meta(session),
                    other_keys=_others(session, turn),
                    now=now,
                    fallback_ttl=self.ttl_s,
                    turn=turn,
                    queued_status=queued,
                    resend_after=after,
                ),
            )
            for session, turn in sessions.items()
        ]
        replies = await run_scripts_async(self.redis, calls)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        touched = Touched()
        for (session, turn), reply in zip(sessions.items(), replies, strict=True):
            if not reply:
                touched.gone.append(session)
            elif int(reply) == 2:
                await self.enqueue(session, turn)
                touched.resent.append((session, turn))
        return touched

    async def read_turn(self, session: str, turn: int) -> tuple[list[TurnEvent], str]:
        """Every event of a turn so far, and the stream id to follow live from."""
        entries = await self.redis.xrange(keys.turn_stream(session, turn)) or []
        events = [decode_event(fields) for _, fields in entries]
        last_id = as_str(entries[-1][0]) if entries else "0-0"
        return events, last_id

    async def engines_alive(self, within_s: float) -> int:
        return int(await self.redis.zcount(keys.ENGINES, self.clock() - within_s, "+inf"))

    async def engine_metrics(self, within_s: float) -> dict[str, bytes]:
        """The metrics exposition of each engine alive now, by engine id (an engine
        that has not published one yet is left out)."""
        names = await self.redis.zrangebyscore(keys.ENGINES, self.clock() - within_s, "+inf")
        ids = [as_str(name) for name in names]
        if not ids:
            return {}
        texts = await self.redis.mget([keys.engine_metrics(i) for i in ids])
        return {
            i: t if isinstance(t, bytes) else str(t).encode()
            for i, t in zip(ids, texts, strict=True)
            if t is not None
        }

    async def capacity(self, within_s: float) -> QueueState:
        """The engines alive now and the shared queue's counters, in one round trip."""
        pipe: Pipeline = self.redis.pipeline(transaction=False)
        pipe.zrangebyscore(keys.ENGINES, self.clock() - within_s, "+inf")
        pipe.xinfo_groups(keys.REQUESTS)
        pipe.xlen(keys.REQUESTS)
        names, groups, length = await pipe.execute(raise_on_error=False)
        if isinstance(names, Exception):
            raise names
        alive = frozenset(as_str(n) for n in names)
        if isinstance(groups, Exception) or isinstance(length, Exception):
            return QueueState(alive, 0, None, 0)  # no queue yet: nothing is waiting
        group = next((g for g in groups if as_str(g["name"]) == keys.ENGINE_GROUP), None)
        if group is None:
            return QueueState(alive, int(length), None, 0)
        taken = group.get("entries-read")  # Redis 7: the group's count of entries read
        return QueueState(
            alive,
            int(group.get("lag") or 0),
            None if taken is None else int(taken),
            int(group.get("pending") or 0),
        )

    async def queue_depth(self) -> int:
        """Turns queued but not yet taken by any engine."""
        try:
            groups = await self.redis.xinfo_groups(keys.REQUESTS)
        except aioredis.ResponseError:
            return 0
        lag = engine_group_lag(groups)
        return int(await self.redis.xlen(keys.REQUESTS)) if lag is None else lag


@dataclass
class Touched:
    """What ``SessionStore.touch`` found."""

    gone: list[str] = field(default_factory=list)  # sessions that no longer exist
    resent: list[tuple[str, int]] = field(default_factory=list)  # turns re-sent to engines


@dataclass(frozen=True)
class QueueState:
    """The shared work queue as a frontend's admission sees it."""

    alive: frozenset[str]  # engines with a fresh heartbeat
    waiting: int  # turns queued that no engine has taken
    taken: int | None  # turns the engines ever took from it (None: not known)
    running: int  # turns taken and not finished (acknowledged at their end)


def _started(session: str, token: str, turn: int, repeat: tuple[int, str] | None) -> Started:
    if repeat is None:
        return Started(session, token, turn, target(Action.START).value)
    return Started(session, token, repeat[0], repeat[1], repeat=True)


def _others(session: str, turn: int, *named: str) -> list[str]:
    """The session's keys (up to ``turn``) other than its meta and the ``named``
    ones a script takes by name: a turn start pushes back their expiry too, so
    no earlier turn expires first; a touch, all of them; a close deletes them."""
    skip = {keys.meta(session), *named}
    return [k for k in keys.session_keys(session, turn) if k not in skip]


__all__ = [
    "CLOSE_LINGER_S",
    "DEFAULT_SESSION_TTL_S",
    "ControlResult",
    "ModeMismatch",
    "SessionInfo",
    "SessionNotFound",
    "SessionStore",
    "QueueState",
    "Started",
    "TurnInput",
    "hash_token",
]


def _finish_arg(action: Action) -> str:
    """How the turn must have ended for ``action``, as CONTROL receives it ('' for any)."""
    finished = required_finish(action)
    return finished.value if finished else ""
