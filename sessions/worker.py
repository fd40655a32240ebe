"""The engine's view of session state in Redis (synchronous: the engine loop is).

Taking work from the requests stream, claiming turns under a lease, reading
the token log to rebuild a turn, publishing each step's events fenced by the
claim's epoch, and polling the control flags of the turns it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import msgpack
import redis

from wsinfer.clock import Clock
from wsinfer.sessions import keys, scripts
from wsinfer.sessions.connect import is_cluster
from wsinfer.sessions.schema import (
    DEFAULT_SESSION_TTL_S,
    Control,
    DeltaEvent,
    DoneEvent,
    PausedEvent,
    SessionMeta,
    TurnEvent,
    TurnInput,
    TurnRequest,
    as_str,
    decode_event,
    decode_request,
    encode,
    engine_group_lag,
    pack,
)
from wsinfer.sessions.scripting import ScriptCall, bound, load_scripts_once, run_scripts
from wsinfer.sessions.scripts import ClaimCall, PublishCall, ReleaseCall, Reply
from wsinfer.sessions.states import Action, allowed_from, statuses_arg, target

# An engine's metrics (``heartbeat``) outlive it this long: a few of its
# publishes, so that a scrape never misses a live one and a dead one's go.
METRICS_TTL_S = 20


@dataclass(frozen=True)
class WorkItem:
    stream: str
    entry_id: str
    request: TurnRequest


@dataclass(frozen=True)
class ClaimedTurn:
    session: str
    turn: int
    epoch: int
    control: Control
    meta: SessionMeta


@dataclass(frozen=True)
class Published:
    """What a turn's deltas hold so far: its tokens, its last seq (where a rebuild
    continues), and what the model wrote (calls included)."""

    ids: list[int]
    seq: int
    text: str
    # The seq of the latest ``done`` the stream holds, which a turn goes on past
    # only once continued (0: it never ended).
    ended_at: int = 0


@dataclass
class TurnHistory:
    """Everything needed to rebuild a turn's context from the token log."""

    current: TurnInput
    # Earlier turns of a chat session: (their new messages, the assistant's text).
    chat_turns: list[tuple[list[dict[str, str]], str]] = field(default_factory=list)
    # Text sessions: the previous turn's prompt ids + generated ids.
    previous_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Publish:
    """One step's events for one turn."""

    session: str
    turn: int
    epoch: int
    seq: int
    events: list[TurnEvent]
    fields: dict[str, Any] = field(default_factory=dict)
    prev_seq: int | None = None  # the seq this continues from; None: unchecked
    # What a final paused event becomes if the client's stop got there first.
    if_stopped: DoneEvent | None = None

    @cached_property  # asked three times a publish, once per delta
    def final_action(self) -> Action | None:
        last = self.events[-1] if self.events else None
        if isinstance(last, DoneEvent):
            return Action.FINISH
        if isinstance(last, PausedEvent):
            return Action.ENGINE_PAUSE
        return None


class PendingPublish:
    """A step's PUBLISH call on its way: sent on a connection of its own, its
    reply read by ``result`` once the engine has computed the next step."""

    def __init__(
        self,
        store: WorkerStore,
        publishes: list[Publish],
        results: list[PublishResult] | None = None,
    ) -> None:
        self.store = store
        self.publishes = publishes
        self._results = results
        self._connection: Any = None

    def send(self, call_keys: list[str], args: list[Any]) -> None:
        load_scripts_once(self.store.redis, [self.store._publish])
        pool = self.store.redis.connection_pool
        connection = pool.get_connection()
        try:
            connection.send_command(
                "EVALSHA", self.store._publish.sha, len(call_keys), *call_keys, *args
            )
        except BaseException:
            connection.disconnect()
            pool.release(connection)
            raise
        self._connection = connection

    def result(self) -> list[PublishResult]:
        """The replies, in order; raises what a failed call raises (then
        nothing is known of what Redis took: publish the same items again)."""
        if self._results is not None:
            return self._results
        pool, connection = self.store.redis.connection_pool, self._connection
        self._connection = None
        try:
            reply = connection.read_response()
        except redis.exceptions.NoScriptError:  # a Redis restarted empty: the call did nothing
            pool.release(connection)
            self._results = self.store.publish_many(self.publishes)  # loads the script, again
            return self._results
        except BaseException:
            connection.disconnect()  # its reply is lost: nobody may read it in its place
            pool.release(connection)
            raise
        pool.release(connection)
        self._results = self.store._publish_results(reply, len(self.publishes))
        return self._results


@dataclass(frozen=True)
class PublishResult:
    outcome: Reply  # ok | fenced | not_found | illegal | gap
    control: Control = Control.NONE
    seen_at: float = 0.0


class WorkerStore:
    """The engine's session operations.

    ``clock``: wall-clock seconds, as heartbeats and claim times are compared
    across processes (a frontend's routing, another engine's takeover scan).
    """

    def __init__(
        self,
        client: redis.Redis,
        engine_id: str,
        *,
        ttl_s: int = DEFAULT_SESSION_TTL_S,
        clock: Clock = time.time,
    ) -> None:
        self.redis = client
        self.engine_id = engine_id
        self.ttl_s = ttl_s
        self.clock = clock
        self._claim = client.register_script(scripts.CLAIM)
        self._publish = client.register_script(scripts.PUBLISH)
        self._release = client.register_script(scripts.RELEASE)

    # --- the work queue -------------------------------------------------
    #
    # Work arrives on the shared queue, or on this engine's own queue when a
    # frontend routes a turn to the engine holding its KV cache. Both are read
    # through the same consumer group; a dead engine's own queue is drained by
    # the others, so routing never strands a turn.

    @property
    def own_queue(self) -> str:
        return keys.engine_requests(self.engine_id)

    def ensure_group(self) -> None:
        for stream in (keys.REQUESTS, self.own_queue):
            try:
                self.redis.xgroup_create(stream, keys.ENGINE_GROUP, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def heartbeat(self, metrics: bytes | None = None) -> int:
        """Say this engine is alive; the shared keys live while some engine does.
        ``metrics``: its exposition for the frontends' ``/metrics``, kept a few
        heartbeats (``METRICS_TTL_S``) so that a dead engine's go with it.

        The registry and the queues expire ``ttl_s`` after the last engine's
        last heartbeat: by then every session they could mention is gone too.
        Returns the turns queued in Redis that no engine has taken yet (the
        shared queue's and this engine's own): an engine takes only what its
        batch has room for, so this, not its own waiting count, is the backlog.
        """
        pipe = self.redis.pipeline(transaction=False)
        pipe.zadd(keys.ENGINES, {self.engine_id: self.clock()})
        if metrics is not None:
            pipe.set(keys.engine_metrics(self.engine_id), metrics, ex=METRICS_TTL_S)
        for key in (keys.ENGINES, keys.REQUESTS, self.own_queue):
            pipe.expire(key, self.ttl_s)
        for queue in (keys.REQUESTS, self.own_queue):
            pipe.xinfo_groups(queue)
        *done, shared, own = pipe.execute(raise_on_error=False)
        for reply in done:
            if isinstance(reply, Exception):
                raise reply
        return sum(
            0 if isinstance(groups, Exception) else engine_group_lag(groups) or 0
            for groups in (shared, own)  # an error: no such queue yet
        )

    def deregister(self) -> None:
        """Mark this engine dead at once; the others drain its own queue.

        With nothing left in its own queue, it is simply forgotten.
        """
        if self._drained(self.own_queue):
            pipe = self.redis.pipeline(transaction=True)
            pipe.zrem(keys.ENGINES, self.engine_id)
            pipe.delete(self.own_queue)
            pipe.execute()
        else:
            self.redis.zadd(keys.ENGINES, {self.engine_id: 0})

    def _drained(self, stream: str) -> bool:
        """Nothing in ``stream`` waits to be read or acknowledged."""
        try:
            groups = self.redis.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream
            return True
        return all(not g.get("pending") and not g.get("lag") for g in groups)

    def release(self, turns: list[tuple[WorkItem, int]]) -> None:
        """Give running turns (work item, claim epoch) back to the shared queue,
        queued again, for any engine to claim at once; a turn another engine
        took over meanwhile is left to it (its entry is no longer ours to ack)."""
        for item, epoch in turns:
            request = item.request
            call = ReleaseCall(
                meta=keys.meta(request.session),
                engine_id=self.engine_id,
                epoch=epoch,
                allowed_from=statuses_arg(allowed_from(Action.RELEASE)),
                target=target(Action.RELEASE).value,
            )
            outcome = as_str(self._release(keys=call.keys(), args=call.args())[0])
            if outcome == Reply.OK:
                self.redis.xadd(keys.REQUESTS, encode(request), maxlen=keys.REQUESTS_MAXLEN)
            if outcome != Reply.FENCED:
                self.ack(item)

    def read_work(self, count: int, block_ms: int | None) -> list[WorkItem]:
        streams = {self.own_queue: ">", keys.REQUESTS: ">"}  # our own (cache hits) first
        return self._read_group(streams, count, block_ms)

    def _read_group(
        self, streams: dict[Any, Any], count: int, block_ms: int | None
    ) -> list[WorkItem]:
        reply: Any = self.redis.xreadgroup(
            keys.ENGINE_GROUP, self.engine_id, streams, count=count, block=block_ms
        )
        return [
            self._item(as_str(stream), entry)
            for stream, entries in reply or []
            for entry in entries
        ]

    def take_over_expired(self, min_idle_ms: int, count: int) -> list[WorkItem]:
        """Work whose engine stopped renewing its lease (crashed or hung)."""
        items = self._autoclaim(keys.REQUESTS, min_idle_ms, count)
        for dead in self._dead_engines(min_idle_ms / 1000):
            queue = keys.engine_requests(dead)
            taken = self._autoclaim(queue, 0, count)  # all of a dead engine's work
            if self.redis.exists(queue):
                taken += self._read_group({queue: ">"}, count, None)
            if not taken:  # drained: forget it (its queue expires with the sessions)
                self.redis.zrem(keys.ENGINES, dead)
                self.redis.expire(queue, self.ttl_s)
            items += taken
        return items

    def _dead_engines(self, silent_s: float) -> list[str]:
        names = self.redis.zrangebyscore(keys.ENGINES, "-inf", self.clock() - silent_s)
        return [name for name in map(as_str, names) if name != self.engine_id]

    def _autoclaim(self, stream: str, min_idle_ms: int, count: int) -> list[WorkItem]:
        try:
            reply = self.redis.xautoclaim(
                stream, keys.ENGINE_GROUP, self.engine_id, min_idle_ms, "0-0", count=count
            )
        except redis.ResponseError:  # no such stream or group: nothing to take
            return []
        return [self._item(stream, entry) for entry in reply[1] if entry and entry[1]]

    def renew_leases(self, items: list[WorkItem]) -> None:
        """Reset the idle time of our pending work so nobody takes it over."""
        by_stream: dict[str, list[Any]] = {}
        for item in items:
            by_stream.setdefault(item.stream, []).append(item.entry_id)
        for stream, ids in by_stream.items():
            self.redis.xclaim(stream, keys.ENGINE_GROUP, self.engine_id, 0, ids, justid=True)

    def ack(self, item: WorkItem) -> None:
        self.redis.xack(item.stream, keys.ENGINE_GROUP, item.entry_id)

    @staticmethod
    def _item(stream: str, entry: Any) -> WorkItem:
        entry_id, fields = entry
        return WorkItem(stream, as_str(entry_id), decode_request(fields))

    # --- claiming and rebuilding a turn -----------------------------------

    def claim(self, request: TurnRequest, *, takeover: bool) -> ClaimedTurn | None:
        """Take the turn; None if it is no longer ours to run (skip and ack)."""
        statuses = allowed_from(Action.CLAIM) if takeover else [allowed_from(Action.CLAIM)[0]]
        call = ClaimCall(
            meta=keys.meta(request.session),
            engine_id=self.engine_id,
            turn=request.turn,
            now=int(self.clock()),
            allowed_from=statuses_arg(statuses),
            target=target(Action.CLAIM).value,
        )
        flat = [as_str(v) for v in self._claim(keys=call.keys(), args=call.args())]
        if flat[0] != Reply.OK:
            return None
        meta = SessionMeta.from_hash(dict(zip(flat[1::2], flat[2::2], strict=True)))
        control = Control.of(meta.control)
        return ClaimedTurn(request.session, request.turn, meta.epoch, control, meta)

    def load_history(self, session: str, turn: int) -> TurnHistory:
        current = self._turn_input(session, turn)
        history = TurnHistory(current=current)
        if turn == 1:
            return history
        if current.mode == "text":
            history.previous_ids = self.load_prompt(session, turn - 1) or []
            history.previous_ids += self.read_generated(session, turn - 1)[0]
            return history
        for earlier in range(1, turn):
            past = self._turn_input(session, earlier)
            text = self.read_published(session, earlier).text
            history.chat_turns.append((past.messages or [], text))
        return history

    def _turn_input(self, session: str, turn: int) -> TurnInput:
        raw = self.redis.get(keys.turn_input(session, turn))
        if raw is None:
            raise LookupError(f"turn {turn} of session {session} has no input")
        return TurnInput.unpack(raw if isinstance(raw, bytes) else raw.encode())

    def load_prompt(self, session: str, turn: int) -> list[int] | None:
        raw = self.redis.get(keys.turn_prompt(session, turn))
        return None if raw is None else list(msgpack.unpackb(raw))

    def save_prompt(self, claimed: ClaimedTurn, prompt_ids: list[int]) -> None:
        """Record the turn's prompt ids, to live as long as the session's other keys."""
        packed = msgpack.packb(prompt_ids)
        key = keys.turn_prompt(claimed.session, claimed.turn)
        self.redis.set(key, packed, ex=claimed.meta.ttl)

    def read_generated(self, session: str, turn: int) -> tuple[list[int], int]:
        """The turn's published tokens and its last seq: where a rebuild continues."""
        published = self.read_published(session, turn)
        return published.ids, published.seq

    def read_published(self, session: str, turn: int) -> Published:
        """Everything the turn's deltas hold, from one read of its stream."""
        events = self._events(session, turn)
        deltas = [e for e in events if isinstance(e, DeltaEvent)]
        ends = [e.seq for e in events if isinstance(e, DoneEvent)]
        return Published(
            [token for e in deltas for token in e.tokens],
            deltas[-1].seq if deltas else 0,
            "".join(e.model_text for e in deltas),
            ends[-1] if ends else 0,
        )

    def _events(self, session: str, turn: int) -> list[TurnEvent]:
        entries = self.redis.xrange(keys.turn_stream(session, turn)) or []
        return [decode_event(fields) for _, fields in entries]

    # --- per step ------------------------------------------------------------

    def publish_many(self, publishes: list[Publish]) -> list[PublishResult]:
        """One round trip for a whole step's events, each fenced by its epoch:
        one script call for the step on one Redis, one call per turn on a
        cluster (a call's keys must share a slot, and its fan-in waits on
        each session's wake channel)."""
        if not publishes:
            return []
        cluster = is_cluster(self.redis)
        groups = [[item] for item in publishes] if cluster else [publishes]
        calls: list[ScriptCall] = [
            bound(self._publish, self._publish_call(g, cluster)) for g in groups
        ]
        results: list[PublishResult] = []
        for group, reply in zip(groups, run_scripts(self.redis, calls), strict=True):
            if isinstance(reply, Exception):
                raise reply
            results += self._publish_results(reply, len(group))
        return results

    def publish_start(self, publishes: list[Publish]) -> PendingPublish:
        """``publish_many``, sent now and answered by ``PendingPublish.result``:
        the engine computes its next step while Redis writes this one. On a
        cluster (a call per turn, to several nodes) the calls run now."""
        if not publishes or is_cluster(self.redis):
            return PendingPublish(self, publishes, self.publish_many(publishes))
        pending = PendingPublish(self, publishes)
        call = self._publish_call(publishes, cluster=False)
        pending.send(call.keys(), call.args())
        return pending

    def _publish_call(self, group: list[Publish], cluster: bool) -> PublishCall:
        turn_keys: list[str] = []
        for item in group:
            turn_keys += [keys.meta(item.session), keys.turn_stream(item.session, item.turn)]
            if cluster:
                turn_keys.append(keys.session_wake(item.session))
        return PublishCall(
            turn_keys=turn_keys,
            engine_id=self.engine_id,
            fallback_ttl=self.ttl_s,
            use_wake="1" if cluster else "0",
            turns=[self._publish_turn(item) for item in group],
        )

    def _publish_results(self, reply: bytes, count: int) -> list[PublishResult]:
        replies = msgpack.unpackb(reply, raw=False)
        if len(replies) != count:
            raise ValueError(f"publish answered {len(replies)} of {count} turns")
        return [self._publish_result(one) for one in replies]

    def _publish_turn(self, item: Publish) -> list[Any]:
        """One turn of a PUBLISH call (its layout is the script's)."""
        final = item.final_action
        # A pause can meet a stop the client sent meanwhile: the script then
        # applies the stop (the table's paused --stop--> done) in the same call.
        stop = final is Action.ENGINE_PAUSE
        if stop and item.if_stopped is None:
            raise ValueError("a pause must say what it becomes if a stop got there first")
        fields: list[str] = []
        for name, value in item.fields.items():  # strings: Lua would print big numbers as 1e+15
            fields += [name, str(value)]
        last = item.events[-1] if final is Action.FINISH else None
        if isinstance(last, DoneEvent):  # how it ended, for a control that asks (a continue)
            fields += ["finish", last.finish_reason]
        return [
            item.epoch,
            item.seq,
            -1 if item.prev_seq is None else item.prev_seq,
            statuses_arg(allowed_from(final)) if final else "",
            target(final).value if final else "",
            statuses_arg(allowed_from(Action.STOP)) if stop else "",
            target(Action.STOP).value if stop else "",
            pack(item.if_stopped) if item.if_stopped and stop else "",
            [pack(event) for event in item.events],
            fields,
        ]

    @staticmethod
    def _publish_result(reply: list[str]) -> PublishResult:
        if reply[0] != Reply.OK:
            return PublishResult(Reply(reply[0]))
        return PublishResult(Reply.OK, Control.of(reply[1]), float(reply[2] or 0))

    def poll(self, sessions: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[Control, float]]:
        """Control flag and last-watched time of each turn; missing = session gone."""
        pipe = self.redis.pipeline(transaction=False)
        for session, _ in sessions:
            pipe.hmget(keys.meta(session), ["turn", "control", "seen_at"])
        out: dict[tuple[str, int], tuple[Control, float]] = {}
        for key, (turn, control, seen_at) in zip(sessions, pipe.execute(), strict=True):
            if turn is not None and int(turn) == key[1]:
                out[key] = (Control.of(as_str(control or "")), float(seen_at or 0))
        return out
